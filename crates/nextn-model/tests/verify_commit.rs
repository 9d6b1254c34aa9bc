//! Speculative verify + commit must leave exactly the state that decoding the kept rows one at a
//! time leaves: same recurrent states, same KV, bit-identical logits afterwards.

use std::path::Path;
use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{KvType, LogitRows, Model};
use nextn_quant::kernels::ThreadPool;

fn bundled() -> Model {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny-qwen35-mtp-Q8_0.gguf");
    Model::load(Arc::new(GgufFile::open(p).expect("bundled model"))).expect("load")
}

#[test]
fn commit_of_any_prefix_equals_plain_decoding() {
    let model = bundled();
    let pool = ThreadPool::new(2);
    let prompt: Vec<u32> = vec![618, 553, 198, 618, 672, 925, 544, 2356, 731];
    let rows: Vec<u32> = vec![258, 581, 672, 198, 17];
    let probe = [1000u32, 42];
    for keep in 0..=rows.len() {
        let mut plain = model.new_sequence(128, KvType::F16, KvType::F16);
        model.forward(&prompt, &mut plain, LogitRows::None, &pool).unwrap();
        let mut plain_logits = Vec::new();
        for &t in &rows[..keep] {
            plain_logits.push(model.forward(&[t], &mut plain, LogitRows::Last, &pool).unwrap().logits);
        }
        let plain_snapshot = plain.snapshot_recurrent();
        let after_plain = model.forward(&probe, &mut plain, LogitRows::All, &pool).unwrap();

        let mut spec = model.new_sequence(128, KvType::F16, KvType::F16);
        model.forward(&prompt, &mut spec, LogitRows::None, &pool).unwrap();
        let verify = model.forward_verify(&rows, &mut spec, &pool).unwrap();
        for (i, l) in plain_logits.iter().enumerate() {
            assert!(verify.logits_row(i) == &l[..], "verify row {i} differs from its one-row decode");
        }
        model.commit(&mut spec, keep).unwrap();
        assert_eq!(spec.n_past, prompt.len() + keep);
        assert!(spec.snapshot_recurrent() == plain_snapshot, "keep {keep}: recurrent states differ");
        let after_spec = model.forward(&probe, &mut spec, LogitRows::All, &pool).unwrap();
        assert!(after_spec.logits == after_plain.logits, "keep {keep}: logits after commit differ from plain decoding");
        assert!(after_spec.hidden == after_plain.hidden, "keep {keep}: hidden states after commit differ");
    }
}

#[test]
fn uncommitted_verify_blocks_further_decoding() {
    let model = bundled();
    let pool = ThreadPool::new(1);
    let mut st = model.new_sequence(64, KvType::F32, KvType::F32);
    model.forward(&[1, 2, 3], &mut st, LogitRows::None, &pool).unwrap();
    model.forward_verify(&[4, 5], &mut st, &pool).unwrap();
    assert!(model.forward(&[6], &mut st, LogitRows::Last, &pool).is_err());
    assert!(model.commit(&mut st, 3).is_err());
    model.commit(&mut st, 1).unwrap();
    assert_eq!(st.n_past, 4);
    model.forward(&[6], &mut st, LogitRows::Last, &pool).unwrap();
}

#[test]
fn context_overflow_is_an_error_not_a_panic() {
    let model = bundled();
    let pool = ThreadPool::new(1);
    let mut st = model.new_sequence(4, KvType::F16, KvType::F16);
    let err = model.forward(&[1, 2, 3, 4, 5], &mut st, LogitRows::Last, &pool).unwrap_err();
    assert!(err.to_string().contains("context is full"), "{err}");
    let err = model.forward(&[9_999_999], &mut st, LogitRows::Last, &pool).unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
}

#[test]
fn forward_is_deterministic() {
    let model = bundled();
    let pool = ThreadPool::new(2);
    let prompt: Vec<u32> = vec![618, 553, 198, 618, 672, 925, 544, 2356, 731];
    let mut a = model.new_sequence(64, KvType::F16, KvType::F16);
    let mut b = model.new_sequence(64, KvType::F16, KvType::F16);
    let la = model.forward(&prompt, &mut a, LogitRows::All, &pool).unwrap();
    let lb = model.forward(&prompt, &mut b, LogitRows::All, &pool).unwrap();
    assert!(la.logits == lb.logits, "logits differ between identical runs");
    assert!(a.snapshot_recurrent() == b.snapshot_recurrent(), "states differ between identical runs");
}
