//! The NextN head against llama.cpp's teacher-forced MTP rows and 3-step draft chains
//! (../shared/golden), and against the tiny model's JAX reference.

use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{KvType, LogitRows, Model, NextnHead};
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

/// Head inputs for teacher forcing: row p pairs token p with the target hidden of p−1 (zeros at p = 0).
fn shifted_hidden(hidden: &[f32], n: usize, e: usize) -> Vec<f32> {
    let mut h = vec![0.0f32; n * e];
    h[e..].copy_from_slice(&hidden[..(n - 1) * e]);
    h
}

fn check_fixture(name: &str, variant: &str) {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let dir = golden.join(name);
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let v = &golden["variants"][variant];
    let model = Model::load(Arc::new(
        GgufFile::open(dir.join(v["model"].as_str().unwrap())).unwrap(),
    ))
    .unwrap();
    let head = NextnHead::load(&model).unwrap();
    let pool = ThreadPool::new(2);
    let e = model.config.n_embd;
    let tol = 2e-3;
    let mut rows = 0;
    for seq in v["sequences"].as_array().unwrap() {
        let toks = ids(&seq["tokens"]);
        let n = toks.len();
        let mut st = model.new_sequence(4096, KvType::F32, KvType::F32).unwrap();
        let target = model
            .forward(&toks, &mut st, LogitRows::All, &pool)
            .unwrap();
        let mut head_kv = head.new_cache(KvType::F32, KvType::F32, 4096).unwrap();
        let hprev = shifted_hidden(&target.hidden, n, e);
        let out = head
            .forward(&toks, &hprev, 0, &mut head_kv, LogitRows::All, &pool)
            .unwrap();
        for (p, row) in seq["mtp"].as_array().unwrap().iter().enumerate() {
            let ours = out.logits_row(p);
            for t in row["top"].as_array().unwrap() {
                let id = t[0].as_u64().unwrap() as usize;
                let want = t[1].as_f64().unwrap();
                let d = (ours[id] as f64 - want).abs();
                assert!(
                    d <= tol,
                    "{name} {} mtp row {p} token {id}: {} vs {want}",
                    seq["name"],
                    ours[id]
                );
            }
            rows += 1;
        }
        // The 3-step chain after the sequence: greedy[0] at position n seeded by the target's last hidden,
        // then the head's own output hidden.
        let draft = &seq["mtp_draft"];
        let mut token = draft["id_last"].as_u64().unwrap() as u32;
        let mut h = target.hidden[(n - 1) * e..].to_vec();
        for (i, step) in draft["steps"].as_array().unwrap().iter().enumerate() {
            let o = head
                .forward(&[token], &h, n + i, &mut head_kv, LogitRows::Last, &pool)
                .unwrap();
            let top = step["top10"].as_array().unwrap();
            let margin = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
            let got = argmax(o.logits_row(0));
            if margin > 2.0 * tol {
                assert_eq!(
                    got as u64,
                    step["draft_token"].as_u64().unwrap(),
                    "{name} {} draft step {i}",
                    seq["name"]
                );
            }
            token = got;
            h = o.hidden;
        }
    }
    eprintln!("{name} {variant}: {rows} teacher-forced MTP rows match");
}

#[test]
fn dense_head_matches_llamacpp() {
    check_fixture("q35-dense-a", "F32");
}

#[test]
fn moe_head_matches_llamacpp() {
    check_fixture("q35moe-a", "F32");
    check_fixture("q35moe-b", "F32");
}

#[test]
fn tied_head_with_qwen_vocab_matches_llamacpp() {
    check_fixture("q35-dense-qwenvocab", "F32-embQ8_0");
}

#[test]
fn tiny_model_head_matches_jax() {
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
    let head = NextnHead::load(&model).unwrap();
    let pool = ThreadPool::new(2);
    let e = model.config.n_embd;
    for g in golden["goldens"].as_array().unwrap() {
        let toks = ids(&g["prompt_ids"]);
        let n = toks.len();
        let mut st = model.new_sequence(4096, KvType::F32, KvType::F32).unwrap();
        let target = model
            .forward(&toks, &mut st, LogitRows::All, &pool)
            .unwrap();
        let mut kv = head.new_cache(KvType::F32, KvType::F32, 4096).unwrap();
        let out = head
            .forward(
                &toks,
                &shifted_hidden(&target.hidden, n, e),
                0,
                &mut kv,
                LogitRows::All,
                &pool,
            )
            .unwrap();
        for (p, want) in ids(&g["mtp_rows_argmax_teacher_forced"]).iter().enumerate() {
            assert_eq!(
                argmax(out.logits_row(p)),
                *want,
                "teacher-forced MTP row {p}"
            );
        }
        let next = g["mtp_input"]["token_id"].as_u64().unwrap() as u32;
        let o = head
            .forward(
                &[next],
                &target.hidden[(n - 1) * e..],
                n,
                &mut kv,
                LogitRows::Last,
                &pool,
            )
            .unwrap();
        for t in g["mtp_top5"].as_array().unwrap() {
            let id = t["id"].as_u64().unwrap() as usize;
            let want = t["logit"].as_f64().unwrap();
            assert!(
                (o.logits[id] as f64 - want).abs() < 2e-3,
                "MTP draft logit of {id}: {} vs {want}",
                o.logits[id]
            );
        }
    }
}
