//! The NextN head over the rows of several sequences in one pass gives, bit for bit, what each
//! sequence gives alone, with the full LM head and with a trimmed draft vocabulary.

use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{HeadBatchItem, KvType, LogitRows, Model, NextnHead, Readback};
use nextn_quant::kernels::ThreadPool;

#[test]
fn head_batch_equals_one_sequence_at_a_time() {
    let file = Arc::new(GgufFile::open(nextn_testdata::bundled_model()).expect("bundled model"));
    let model = Model::load(file).expect("load");
    let mut head = NextnHead::load(&model).expect("head");
    let pool = ThreadPool::new(2);
    check(&model, &head, &pool);
    // With a draft vocabulary the batched head must trim its logits the same way.
    let kept: Vec<u32> = (0..8192).step_by(3).collect();
    head.restrict_vocab(&kept).unwrap();
    check(&model, &head, &pool);
}

fn check(model: &Model, head: &NextnHead, pool: &ThreadPool) {
    let n_embd = model.config.n_embd;
    let seqs: Vec<(Vec<u32>, Vec<f32>)> = [3usize, 1, 5]
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let tokens: Vec<u32> = (0..n).map(|i| ((i * 31 + k * 97) % 8000) as u32).collect();
            let hidden: Vec<f32> = (0..n * n_embd)
                .map(|i| ((i * 7 + k) % 13) as f32 / 13.0 - 0.5)
                .collect();
            (tokens, hidden)
        })
        .collect();
    let mut alone = Vec::new();
    for (t, h) in &seqs {
        let mut cache = head.new_cache(KvType::F16, KvType::F16, 4096).unwrap();
        head.forward(&t[..1], &h[..n_embd], 0, &mut cache, LogitRows::Last, pool)
            .unwrap();
        alone.push(
            head.forward(&t[1..], &h[n_embd..], 1, &mut cache, LogitRows::All, pool)
                .unwrap(),
        );
    }
    let mut caches: Vec<_> = seqs
        .iter()
        .map(|_| head.new_cache(KvType::F16, KvType::F16, 4096).unwrap())
        .collect();
    for ((t, h), c) in seqs.iter().zip(caches.iter_mut()) {
        head.forward(&t[..1], &h[..n_embd], 0, c, LogitRows::Last, pool)
            .unwrap();
    }
    let mut items: Vec<HeadBatchItem> = seqs
        .iter()
        .zip(caches.iter_mut())
        .map(|((t, h), cache)| HeadBatchItem {
            tokens: &t[1..],
            hidden_prev: nextn_model::HiddenPrev::Host(&h[n_embd..]),
            start_pos: 1,
            rope_shift: 0,
            cache,
            logits: LogitRows::All,
            readback: Readback::Logits,
        })
        .collect();
    let batched = head.forward_batch(&mut items, pool).unwrap();
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a.hidden, b.hidden);
        assert_eq!(a.logits.len(), b.logits.len());
        for (x, y) in a.logits.iter().zip(&b.logits) {
            assert_eq!(x.to_bits(), y.to_bits());
        }
    }
    let trimmed = head.draft_vocab_size() < head.n_vocab();
    let infinite = batched[0].logits.iter().filter(|v| v.is_infinite()).count();
    assert_eq!(infinite > 0, trimmed, "{infinite} −∞ logits");
    // Wrong hidden widths are refused, naming the numbers.
    let mut cache = head.new_cache(KvType::F16, KvType::F16, 4096).unwrap();
    let err = head
        .forward(&[1, 2], &[0.0; 3], 0, &mut cache, LogitRows::Last, pool)
        .unwrap_err();
    assert!(
        err.to_string().contains("3 hidden values for 2 rows"),
        "{err}"
    );
}

/// Rows whose output nothing reads (`LogitRows::None`, and all but the last under
/// `LogitRows::Last`) only leave their keys and values in the head's cache: the last row's
/// logits and hidden state, and every later row's, are bit for bit what running the whole block
/// over every row gives. Over a context longer than one value chunk, in pieces as a lag runs.
#[test]
fn rows_without_output_leave_the_same_cache_entries() {
    let file = Arc::new(GgufFile::open(nextn_testdata::bundled_model()).expect("bundled model"));
    let model = Model::load(file).expect("load");
    let head = NextnHead::load(&model).expect("head");
    let pool = ThreadPool::new(2);
    let e = model.config.n_embd;
    let n = 1500;
    let tokens: Vec<u32> = (0..n).map(|i| ((i * 37 + 11) % 8000) as u32).collect();
    let hidden: Vec<f32> = (0..n * e)
        .map(|i| ((i * 5 + 3) % 17) as f32 / 17.0 - 0.5)
        .collect();
    // Every row through the whole block.
    let mut full = head.new_cache(KvType::F16, KvType::F16, 4096).unwrap();
    let whole = head
        .forward(&tokens, &hidden, 0, &mut full, LogitRows::All, &pool)
        .unwrap();
    // The same rows as a lag: two pieces without output, then the rest with the last row's.
    let mut lag = head.new_cache(KvType::F16, KvType::F16, 4096).unwrap();
    let cuts = [0, 700, 1200, n];
    let mut last = None;
    for (k, w) in cuts.windows(2).enumerate() {
        let logits = if k + 2 == cuts.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        let out = head
            .forward(
                &tokens[w[0]..w[1]],
                &hidden[w[0] * e..w[1] * e],
                w[0],
                &mut lag,
                logits,
                &pool,
            )
            .unwrap();
        if logits == LogitRows::None {
            assert!(out.hidden.is_empty() && out.logits.is_empty());
        }
        last = Some(out);
    }
    let last = last.unwrap();
    assert_eq!(last.hidden, whole.hidden[(n - 1) * e..]);
    let v = whole.n_vocab;
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same(&last.logits, &whole.logits[(n - 1) * v..]));
    // A next row attends to every entry: equal logits say the entries are equal.
    let next = |cache: &mut nextn_model::LayerCache| {
        head.forward(&[42], &hidden[..e], n, cache, LogitRows::Last, &pool)
            .unwrap()
    };
    let (a, b) = (next(&mut full), next(&mut lag));
    assert_eq!(a.hidden, b.hidden);
    assert!(same(&a.logits, &b.logits));
}
