//! Speculative verify + commit must leave exactly the state that decoding the kept rows one at a
//! time leaves: same recurrent states, same KV, bit-identical logits afterwards.

use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{KvType, LayerCache, LogitRows, Model, RecurrentState, SequenceState};
use nextn_quant::kernels::ThreadPool;

fn bundled() -> Model {
    let p = nextn_testdata::bundled_model();
    Model::load(Arc::new(GgufFile::open(p).expect("bundled model"))).expect("load")
}

/// The committed recurrent state of every delta-net layer.
fn recurrent(s: &SequenceState) -> Vec<RecurrentState> {
    s.layers
        .iter()
        .filter_map(|l| match l {
            LayerCache::DeltaNet(c) => Some(c.state.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn commit_of_any_prefix_equals_plain_decoding() {
    let model = bundled();
    // Every KV cache type: quantized rows too are read the same way by decode, verify and
    // prefill rows.
    for kv in [KvType::F16, KvType::Q8_0, KvType::Q4_0] {
        commit_of_any_prefix_equals_plain_decoding_with(&model, kv);
    }
}

fn commit_of_any_prefix_equals_plain_decoding_with(model: &Model, kv: KvType) {
    let pool = ThreadPool::new(2);
    let prompt: Vec<u32> = vec![618, 553, 198, 618, 672, 925, 544, 2356, 731];
    let rows: Vec<u32> = vec![258, 581, 672, 198, 17];
    let probe = [1000u32, 42];
    // One prefill pass over the prompt and all the rows gives each row's decode logits.
    let mut whole = model.new_sequence(128, kv, kv).unwrap();
    let all: Vec<u32> = prompt.iter().chain(&rows).copied().collect();
    let prefilled = model
        .forward(&all, &mut whole, LogitRows::All, &pool)
        .unwrap();
    for keep in 0..=rows.len() {
        let mut plain = model.new_sequence(128, kv, kv).unwrap();
        model
            .forward(&prompt, &mut plain, LogitRows::None, &pool)
            .unwrap();
        let mut plain_logits = Vec::new();
        for &t in &rows[..keep] {
            plain_logits.push(
                model
                    .forward(&[t], &mut plain, LogitRows::Last, &pool)
                    .unwrap()
                    .logits,
            );
        }
        let plain_snapshot = recurrent(&plain);
        let after_plain = model
            .forward(&probe, &mut plain, LogitRows::All, &pool)
            .unwrap();

        let mut spec = model.new_sequence(128, kv, kv).unwrap();
        model
            .forward(&prompt, &mut spec, LogitRows::None, &pool)
            .unwrap();
        let verify = model.forward_verify(&rows, &mut spec, &pool).unwrap();
        for (i, l) in plain_logits.iter().enumerate() {
            assert!(
                verify.logits_row(i) == &l[..],
                "{kv:?}: verify row {i} differs from its one-row decode"
            );
            assert!(
                prefilled.logits_row(prompt.len() + i) == &l[..],
                "{kv:?}: prefill row {i} differs from its one-row decode"
            );
        }
        model.commit(&mut spec, keep).unwrap();
        assert_eq!(spec.n_past, prompt.len() + keep);
        assert!(
            recurrent(&spec) == plain_snapshot,
            "{kv:?}, keep {keep}: recurrent states differ"
        );
        let after_spec = model
            .forward(&probe, &mut spec, LogitRows::All, &pool)
            .unwrap();
        assert!(
            after_spec.logits == after_plain.logits,
            "{kv:?}, keep {keep}: logits after commit differ from plain decoding"
        );
        assert!(
            after_spec.hidden == after_plain.hidden,
            "{kv:?}, keep {keep}: hidden states after commit differ"
        );
    }
}

#[test]
fn uncommitted_verify_blocks_further_decoding() {
    let model = bundled();
    let pool = ThreadPool::new(1);
    let mut st = model.new_sequence(64, KvType::F32, KvType::F32).unwrap();
    model
        .forward(&[1, 2, 3], &mut st, LogitRows::None, &pool)
        .unwrap();
    model.forward_verify(&[4, 5], &mut st, &pool).unwrap();
    assert!(model
        .forward(&[6], &mut st, LogitRows::Last, &pool)
        .is_err());
    assert!(model.commit(&mut st, 3).is_err());
    model.commit(&mut st, 1).unwrap();
    assert_eq!(st.n_past, 4);
    model
        .forward(&[6], &mut st, LogitRows::Last, &pool)
        .unwrap();
}

#[test]
fn context_overflow_is_an_error_not_a_panic() {
    let model = bundled();
    let pool = ThreadPool::new(1);
    let mut st = model.new_sequence(4, KvType::F16, KvType::F16).unwrap();
    let err = model
        .forward(&[1, 2, 3, 4, 5], &mut st, LogitRows::Last, &pool)
        .unwrap_err();
    assert!(err.to_string().contains("context is full"), "{err}");
    let err = model
        .forward(&[9_999_999], &mut st, LogitRows::Last, &pool)
        .unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
}

#[test]
fn forward_is_deterministic() {
    let model = bundled();
    let pool = ThreadPool::new(2);
    let prompt: Vec<u32> = vec![618, 553, 198, 618, 672, 925, 544, 2356, 731];
    let mut a = model.new_sequence(64, KvType::F16, KvType::F16).unwrap();
    let mut b = model.new_sequence(64, KvType::F16, KvType::F16).unwrap();
    let la = model
        .forward(&prompt, &mut a, LogitRows::All, &pool)
        .unwrap();
    let lb = model
        .forward(&prompt, &mut b, LogitRows::All, &pool)
        .unwrap();
    assert!(
        la.logits == lb.logits,
        "logits differ between identical runs"
    );
    assert!(
        recurrent(&a) == recurrent(&b),
        "states differ between identical runs"
    );
}

/// Several sequences in one pass (continuous batching) give exactly what each gives alone,
/// including a verify item that is then committed.
#[test]
fn multi_sequence_batch_equals_separate_passes() {
    use nextn_model::{BatchItem, Readback};
    let model = bundled();
    let pool = ThreadPool::new(2);
    let prompts: [&[u32]; 3] = [&[618, 553, 198, 618], &[5, 6, 7, 8, 9, 10, 11], &[42]];
    let next: [&[u32]; 3] = [&[672], &[12, 13, 14], &[43, 44]];
    // Alone.
    let mut alone = Vec::new();
    for (p, x) in prompts.iter().zip(&next) {
        let mut st = model.new_sequence(64, KvType::F16, KvType::F16).unwrap();
        let a = model.forward(p, &mut st, LogitRows::All, &pool).unwrap();
        let b = model.forward_verify(x, &mut st, &pool).unwrap();
        model.commit(&mut st, 1).unwrap();
        let c = model
            .forward(&[99], &mut st, LogitRows::Last, &pool)
            .unwrap();
        alone.push((a, b, c));
    }
    // Together: prefill all three in one pass, then verify rows of all three in one pass.
    let mut states: Vec<_> = (0..3)
        .map(|_| model.new_sequence(64, KvType::F16, KvType::F16).unwrap())
        .collect();
    let mut it = states.iter_mut();
    let (s0, s1, s2) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let mut items = [
        BatchItem {
            tokens: prompts[0],
            state: s0,
            logits: LogitRows::All,
            readback: Readback::Logits,
            verify: false,
        },
        BatchItem {
            tokens: prompts[1],
            state: s1,
            logits: LogitRows::All,
            readback: Readback::Logits,
            verify: false,
        },
        BatchItem {
            tokens: prompts[2],
            state: s2,
            logits: LogitRows::All,
            readback: Readback::Logits,
            verify: false,
        },
    ];
    let a = model.forward_batch(&mut items, &pool).unwrap();
    let mut it = states.iter_mut();
    let (s0, s1, s2) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let mut items = [
        BatchItem {
            tokens: next[0],
            state: s0,
            logits: LogitRows::All,
            readback: Readback::Logits,
            verify: true,
        },
        BatchItem {
            tokens: next[1],
            state: s1,
            logits: LogitRows::All,
            readback: Readback::Logits,
            verify: true,
        },
        BatchItem {
            tokens: next[2],
            state: s2,
            logits: LogitRows::All,
            readback: Readback::Logits,
            verify: true,
        },
    ];
    let b = model.forward_batch(&mut items, &pool).unwrap();
    for (i, st) in states.iter_mut().enumerate() {
        model.commit(st, 1).unwrap();
        let c = model.forward(&[99], st, LogitRows::Last, &pool).unwrap();
        assert!(
            a[i].logits == alone[i].0.logits && a[i].hidden == alone[i].0.hidden,
            "sequence {i}: prefill differs in a batch"
        );
        assert!(
            b[i].logits == alone[i].1.logits,
            "sequence {i}: verify rows differ in a batch"
        );
        assert!(
            c.logits == alone[i].2.logits,
            "sequence {i}: state after commit differs"
        );
    }
}

/// Past one value chunk of attention (1,024 positions) decode and verify rows share each kv
/// head's positions out over the threads by chunk when a model has fewer kv heads than threads,
/// while a prefill's rows run one task per block of rows: every row still gets the other paths'
/// bits, whatever the thread count. On the bundled model (one kv head, Q8_0) with every cache type
/// and the F32 dense fixture (two kv heads; f32 products carry any difference in the attention
/// output through). Three chunks, so that a changed order of the chunk sums shows.
#[test]
fn long_context_rows_agree_whatever_the_split() {
    let model = bundled();
    for kv in [KvType::F16, KvType::Q8_0, KvType::Q4_0] {
        long_context_rows_agree(&model, kv, &[2, 3]);
    }
    if let Some(golden) = nextn_testdata::shared("golden") {
        let p = golden.join("q35-dense-a/q35-dense-a-F32.gguf");
        let model = Model::load(Arc::new(GgufFile::open(p).expect("fixture"))).expect("load");
        long_context_rows_agree(&model, KvType::F16, &[3, 4]);
    }
}

fn long_context_rows_agree(model: &Model, kv: KvType, thread_counts: &[usize]) {
    let n_prompt = 2_300;
    let vocab = model.n_vocab as u32;
    let prompt: Vec<u32> = (0..n_prompt as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 19) % (vocab - 20) + 10)
        .collect();
    let rows: Vec<u32> = vec![258, 581, 672, 198, 17];
    let all: Vec<u32> = prompt.iter().chain(&rows).copied().collect();
    let one = ThreadPool::new(1);
    let mut whole = model.new_sequence(4096, kv, kv).unwrap();
    let prefilled = model
        .forward(&all, &mut whole, LogitRows::All, &one)
        .unwrap();
    for &threads in thread_counts {
        let pool = ThreadPool::new(threads);
        let mut seq = model.new_sequence(4096, kv, kv).unwrap();
        model
            .forward(&prompt, &mut seq, LogitRows::None, &pool)
            .unwrap();
        let verify = model.forward_verify(&rows, &mut seq, &pool).unwrap();
        model.commit(&mut seq, 0).unwrap();
        for (i, &t) in rows.iter().enumerate() {
            let decoded = model
                .forward(&[t], &mut seq, LogitRows::Last, &pool)
                .unwrap();
            assert!(
                decoded.logits == prefilled.logits_row(n_prompt + i),
                "{kv:?}, {threads} threads: decode row {i} differs from the prefill's"
            );
            assert!(
                verify.logits_row(i) == prefilled.logits_row(n_prompt + i),
                "{kv:?}, {threads} threads: verify row {i} differs from the prefill's"
            );
        }
    }
}
