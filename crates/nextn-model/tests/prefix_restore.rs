//! A sequence resumed from kept attention rows and a recurrent snapshot continues exactly as the
//! sequence it was taken from: bit-identical logits and hidden states, after prefill chunks and
//! after a partly accepted verify batch; mismatched pieces are refused.

use std::path::Path;
use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{KvRows, KvType, LogitRows, Model, ModelError, SequenceState};
use nextn_quant::kernels::ThreadPool;

fn load(path: &Path) -> Model {
    Model::load(Arc::new(GgufFile::open(path).expect("open model"))).expect("load")
}

fn models() -> Vec<Model> {
    let mut out = vec![load(&nextn_testdata::bundled_model())];
    if let Some(golden) = nextn_testdata::shared("golden") {
        for f in [
            "q35-dense-a/q35-dense-a-Q4_K_M.gguf",
            "q35moe-a/q35moe-a-Q8_0.gguf",
        ] {
            out.push(load(&golden.join(f)));
        }
    }
    out
}

fn tokens(model: &Model, n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) % model.n_vocab as u32)
        .collect()
}

/// Resume a fresh sequence from `segments` (row ranges of `from`) and its snapshot.
fn resume(model: &Model, from: &SequenceState, cuts: &[usize], kv: KvType) -> SequenceState {
    let snapshot = from.recurrent_snapshot().expect("committed state");
    let segments: Vec<Vec<KvRows>> = cuts
        .windows(2)
        .map(|w| from.attention_rows(w[0], w[1]).unwrap())
        .collect();
    let mut s = model.new_sequence(256, kv, kv).unwrap();
    s.restore(segments.iter().map(|v| v.as_slice()), &snapshot)
        .expect("restore");
    s
}

#[test]
fn a_resumed_sequence_continues_bit_for_bit() {
    let pool = ThreadPool::new(2);
    for model in models() {
        for kv in [KvType::F16, KvType::F32] {
            let prompt = tokens(&model, 40, 1);
            let rest = tokens(&model, 9, 2);
            let mut cold = model.new_sequence(256, kv, kv).unwrap();
            model
                .forward(&prompt, &mut cold, LogitRows::None, &pool)
                .unwrap();
            let want = model
                .forward(&rest, &mut cold, LogitRows::All, &pool)
                .unwrap();

            // Taken after two prefill chunks, handed over in three pieces.
            let mut warm = model.new_sequence(256, kv, kv).unwrap();
            model
                .forward(&prompt[..25], &mut warm, LogitRows::None, &pool)
                .unwrap();
            model
                .forward(&prompt[25..], &mut warm, LogitRows::None, &pool)
                .unwrap();
            let mut resumed = resume(&model, &warm, &[0, 7, 30, 40], kv);
            assert_eq!(resumed.n_past, 40);
            assert_eq!(
                resumed.recurrent_snapshot().unwrap(),
                warm.recurrent_snapshot().unwrap()
            );
            let got = model
                .forward(&rest, &mut resumed, LogitRows::All, &pool)
                .unwrap();
            assert!(got.logits == want.logits, "logits differ ({kv:?})");
            assert!(got.hidden == want.hidden, "hidden states differ ({kv:?})");
        }
    }
}

#[test]
fn a_snapshot_after_a_partly_kept_verify_batch_resumes_exactly() {
    let pool = ThreadPool::new(2);
    let model = load(&nextn_testdata::bundled_model());
    let prompt = tokens(&model, 20, 3);
    let drafts = tokens(&model, 4, 4);
    let probe = tokens(&model, 3, 5);
    let mut s = model.new_sequence(256, KvType::F16, KvType::F16).unwrap();
    model
        .forward(&prompt, &mut s, LogitRows::None, &pool)
        .unwrap();
    model.forward_verify(&drafts, &mut s, &pool).unwrap();
    // Only committed state can be kept.
    assert!(matches!(
        s.recurrent_snapshot(),
        Err(ModelError::UncommittedVerify { pending: 4 })
    ));
    model.commit(&mut s, 2).unwrap();
    let mut resumed = resume(&model, &s, &[0, 22], KvType::F16);
    let want = model
        .forward(&probe, &mut s, LogitRows::All, &pool)
        .unwrap();
    let got = model
        .forward(&probe, &mut resumed, LogitRows::All, &pool)
        .unwrap();
    assert!(got.logits == want.logits);
}

#[test]
fn pieces_that_do_not_fit_are_refused() {
    let pool = ThreadPool::new(1);
    let model = load(&nextn_testdata::bundled_model());
    let prompt = tokens(&model, 12, 6);
    let mut s = model.new_sequence(256, KvType::F16, KvType::F16).unwrap();
    model
        .forward(&prompt, &mut s, LogitRows::None, &pool)
        .unwrap();
    let snapshot = s.recurrent_snapshot().unwrap();
    let rows = s.attention_rows(0, 12).unwrap();

    // Other KV element types.
    let mut other = model.new_sequence(256, KvType::F32, KvType::F32).unwrap();
    assert!(matches!(
        other.restore([rows.as_slice()], &snapshot),
        Err(ModelError::SnapshotKvType)
    ));
    // Rows that do not reach the snapshot's position.
    let short = s.attention_rows(0, 10).unwrap();
    let mut fresh = model.new_sequence(256, KvType::F16, KvType::F16).unwrap();
    assert!(matches!(
        fresh.restore([short.as_slice()], &snapshot),
        Err(ModelError::SnapshotMismatch {
            what: "attention positions",
            ..
        })
    ));
    // A sequence that already holds positions.
    let mut busy = model.new_sequence(256, KvType::F16, KvType::F16).unwrap();
    model
        .forward(&prompt[..2], &mut busy, LogitRows::None, &pool)
        .unwrap();
    assert!(busy.restore([rows.as_slice()], &snapshot).is_err());
    // A context too small for the snapshot.
    let mut small = model.new_sequence(8, KvType::F16, KvType::F16).unwrap();
    assert!(matches!(
        small.restore([rows.as_slice()], &snapshot),
        Err(ModelError::ContextFull { .. })
    ));
    // Splitting rows keeps every value.
    let mut head = s.attention_rows(0, 12).unwrap().remove(0);
    let tail = head.split_off(5);
    assert_eq!((head.len(), tail.len()), (5, 7));
    assert_eq!(head, s.attention_rows(0, 5).unwrap()[0]);
    assert_eq!(tail, s.attention_rows(5, 12).unwrap()[0]);
    assert_eq!(head.bytes() + tail.bytes(), rows[0].bytes());
}
