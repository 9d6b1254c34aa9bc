//! A quantized KV cache (`-ctk/-ctv q8_0|q4_0`) against llama.cpp's own: on the F32 golden
//! fixtures the logits with a quantized cache differ from the f16-cache logits about as much as
//! llama.cpp's logits differ between the same two caches (tests/data/kv_quant_llamacpp.json, how
//! it was computed is written there): the mean over rows of each row's largest difference within
//! 10 % of llama.cpp's, the largest within 25 %.

use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{KvType, LogitRows, Model};
use nextn_quant::kernels::ThreadPool;
use serde_json::Value;

fn logits(model: &Model, tokens: &[u32], kv: KvType, pool: &ThreadPool) -> Vec<f32> {
    let mut st = model.new_sequence(1024, kv, kv).unwrap();
    model
        .forward(tokens, &mut st, LogitRows::All, pool)
        .expect("forward")
        .logits
}

#[test]
fn quantized_kv_stays_within_llama_cpps_own_difference() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let reference: Value =
        serde_json::from_str(include_str!("data/kv_quant_llamacpp.json")).expect("reference");
    let pool = ThreadPool::new(2);
    for (fixture, limits) in reference["fixtures"].as_object().expect("fixtures") {
        let dir = golden.join(fixture);
        let g: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("golden.json")).expect("golden.json"),
        )
        .expect("parse");
        let tokens: Vec<u32> = g["sequences"]
            .as_array()
            .expect("sequences")
            .iter()
            .find(|s| s["name"] == "code")
            .expect("sequence 'code'")["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect();
        let file = dir.join(format!("{fixture}-F32.gguf"));
        let model = Model::load(Arc::new(GgufFile::open(&file).expect("fixture"))).expect("load");
        let n_vocab = model.n_vocab;
        let base = logits(&model, &tokens, KvType::F16, &pool);
        for (name, ty) in [("q8_0", KvType::Q8_0), ("q4_0", KvType::Q4_0)] {
            let got = logits(&model, &tokens, ty, &pool);
            let row_max: Vec<f64> = got
                .chunks_exact(n_vocab)
                .zip(base.chunks_exact(n_vocab))
                .map(|(a, b)| {
                    a.iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs() as f64)
                        .fold(0.0, f64::max)
                })
                .collect();
            let max = row_max.iter().copied().fold(0.0, f64::max);
            let mean = row_max.iter().sum::<f64>() / row_max.len() as f64;
            let (l_max, l_mean) = (
                limits[name]["max_abs"].as_f64().expect("max_abs"),
                limits[name]["mean_row_max_abs"].as_f64().expect("mean"),
            );
            eprintln!("{fixture} {name}: max {max:.5} (llama.cpp {l_max}), mean row max {mean:.5} (llama.cpp {l_mean})");
            assert!(
                max > 0.0,
                "{fixture} {name}: no difference at all: not quantized?"
            );
            // Both quantize the same values with the same rounding; which row happens to hold
            // the single largest difference varies, so the worst row gets some room and the
            // typical row (mean of the rows' maxima) little.
            assert!(
                max <= 1.25 * l_max && mean <= 1.1 * l_mean,
                "{fixture} {name}: max {max} / mean {mean} beyond llama.cpp's {l_max} / {l_mean}"
            );
        }
    }
}
