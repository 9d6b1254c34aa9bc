//! The trained tiny Qwen3.5 model against its independent JAX reference (../shared/models/tiny-qwen35-mtp).

use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{KvType, LogitRows, Model};
use nextn_quant::kernels::ThreadPool;
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

fn argmax(x: &[f32]) -> u32 {
    x.iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
            if v > b.1 {
                (i, v)
            } else {
                b
            }
        })
        .0 as u32
}

#[test]
fn f32_model_matches_jax_reference() {
    let Some(dir) = nextn_testdata::shared("models/tiny-qwen35-mtp") else {
        return;
    };
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden_jax.json")).unwrap())
            .unwrap();
    let model = Model::load(Arc::new(
        GgufFile::open(dir.join("tiny-qwen35-mtp-F32.gguf")).unwrap(),
    ))
    .unwrap();
    let pool = ThreadPool::new(2);
    for g in golden["goldens"].as_array().unwrap() {
        let prompt = ids(&g["prompt_ids"]);
        let mut st = model.new_sequence(4096, KvType::F32, KvType::F32).unwrap();
        let out = model
            .forward(&prompt, &mut st, LogitRows::All, &pool)
            .unwrap();
        let n = prompt.len();
        for (p, want) in ids(&g["per_position_argmax"]).iter().enumerate() {
            assert_eq!(argmax(out.logits_row(p)), *want, "row {p} argmax");
        }
        let last = out.logits_row(n - 1);
        let full: Vec<f64> = g["last_logits_full"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let max_diff = full
            .iter()
            .zip(last)
            .map(|(a, &b)| (a - b as f64).abs())
            .fold(0.0, f64::max);
        // The reference values are printed with 5 decimals.
        assert!(
            max_diff < 2e-3,
            "last-row logits differ from JAX by {max_diff}"
        );
        let h8: Vec<f64> = g["last_hidden_postnorm_first8"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let e = model.config.n_embd;
        for (i, want) in h8.iter().enumerate() {
            let got = out.hidden[(n - 1) * e + i] as f64;
            assert!((got - want).abs() < 1e-3, "hidden[{i}] {got} vs {want}");
        }
        // 48 greedy tokens, one decode step each.
        let mut logits = last.to_vec();
        for (i, &want) in ids(&g["greedy_48_ids"]).iter().enumerate() {
            assert_eq!(argmax(&logits), want, "greedy step {i}");
            logits = model
                .forward(&[want], &mut st, LogitRows::Last, &pool)
                .unwrap()
                .logits;
        }
    }
}

/// The bundled Q8_0 model: its distance from the JAX reference is no larger than llama.cpp's on the
/// same file (plus a small allowance for rounding flips), and its greedy continuations equal llama.cpp's.
#[test]
fn bundled_q8_0_tracks_llamacpp() {
    let Some(dir) = nextn_testdata::shared("models/tiny-qwen35-mtp") else {
        return;
    };
    let jax: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden_jax.json")).unwrap())
            .unwrap();
    let lc: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("llamacpp_vs_jax_Q8_0.json")).unwrap(),
    )
    .unwrap();
    let bundled = nextn_testdata::bundled_model();
    let model = Model::load(Arc::new(GgufFile::open(bundled).unwrap())).unwrap();
    let pool = ThreadPool::new(2);
    for (g, l) in jax["goldens"]
        .as_array()
        .unwrap()
        .iter()
        .zip(lc["sequences"].as_array().unwrap())
    {
        let prompt = ids(&g["prompt_ids"]);
        let n = prompt.len();
        let mut st = model.new_sequence(4096, KvType::F32, KvType::F32).unwrap();
        let out = model
            .forward(&prompt, &mut st, LogitRows::All, &pool)
            .unwrap();
        // Last row: JAX's full logits, over JAX's top 32.
        let full: Vec<f64> = g["last_logits_full"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let mut order: Vec<usize> = (0..full.len()).collect();
        order.sort_by(|&a, &b| full[b].total_cmp(&full[a]));
        let last = out.logits_row(n - 1);
        let ours = order[..32]
            .iter()
            .map(|&i| (last[i] as f64 - full[i]).abs())
            .fold(0.0, f64::max);
        let theirs = l["target_max_abs_logit_diff_over_top32"].as_f64().unwrap();
        eprintln!(
            "{}: |ours − JAX| {ours:.4} on the last row, llama.cpp's worst row {theirs:.4}",
            l["name"]
        );
        assert!(
            ours <= 1.5 * theirs + 0.02,
            "{}: {ours} vs llama.cpp {theirs}",
            l["name"]
        );
        let want = ids(&l["greedy_llamacpp"]);
        let mut logits = last.to_vec();
        for (i, &w) in want.iter().enumerate() {
            assert_eq!(
                argmax(&logits),
                w,
                "{} greedy step {i} differs from llama.cpp's Q8_0 run",
                l["name"]
            );
            logits = model
                .forward(&[w], &mut st, LogitRows::Last, &pool)
                .unwrap()
                .logits;
        }
    }
}
