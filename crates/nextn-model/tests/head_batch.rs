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
