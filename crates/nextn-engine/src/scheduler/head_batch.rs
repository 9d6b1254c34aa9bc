//! The NextN head over the rows of several sequences in one pass: one `eh_proj` product, one
//! decoder-layer pass (attention per sequence, on its own head cache) and one LM-head product for
//! all slots that draft at the same depth. Each row's result equals [`NextnHead::forward`] on that
//! sequence alone, because every matrix product treats rows independently.

use nextn_model::model::Segment;
use nextn_model::{ForwardOutput, LayerCache, LogitRows, ModelError, NextnHead};
use nextn_quant::kernels::ThreadPool;

/// One sequence's rows for a batched head pass.
pub struct HeadItem<'a> {
    /// Token at each row's position.
    pub tokens: &'a [u32],
    /// Target (or chained head) post-norm hidden state of the position before each row.
    pub hidden_prev: &'a [f32],
    pub start_pos: usize,
    pub cache: &'a mut LayerCache,
    pub logits: LogitRows,
}

/// Run the head over every item's rows at once; one output per item, in order.
pub fn head_forward_batch(
    head: &NextnHead,
    eps: f32,
    items: &mut [HeadItem],
    pool: &ThreadPool,
) -> Result<Vec<ForwardOutput>, ModelError> {
    let e = head.enorm.len();
    let n_vocab = head.n_vocab();
    let n: usize = items.iter().map(|it| it.tokens.len()).sum();
    let mut cat = vec![0.0f32; n * 2 * e];
    let mut row = vec![0.0f32; e];
    let mut starts = Vec::with_capacity(items.len());
    let mut at = 0;
    for it in items.iter() {
        if it.hidden_prev.len() != it.tokens.len() * e {
            return Err(ModelError::Rollback(format!(
                "NextN head got {} hidden values for {} rows of width {e}",
                it.hidden_prev.len(),
                it.tokens.len()
            )));
        }
        starts.push(at);
        for (i, &t) in it.tokens.iter().enumerate() {
            if t as usize >= head.embed.rows {
                return Err(ModelError::TokenOutOfRange {
                    token: t as u64,
                    n_vocab: head.embed.rows,
                });
            }
            head.embed.dequantize_row(t as usize, &mut row)?;
            let dst = &mut cat[(at + i) * 2 * e..(at + i + 1) * 2 * e];
            nextn_model::ops::rms_norm(&row, &head.enorm, eps, &mut dst[..e]);
            nextn_model::ops::rms_norm(
                &it.hidden_prev[i * e..(i + 1) * e],
                &head.hnorm,
                eps,
                &mut dst[e..],
            );
        }
        at += it.tokens.len();
    }
    let mut h = vec![0.0f32; n * e];
    if n > 0 {
        head.eh_proj.forward(&cat, n, &mut h, pool)?;
        let mut segments: Vec<Segment> = items
            .iter_mut()
            .zip(&starts)
            .filter(|(it, _)| !it.tokens.is_empty())
            .map(|(it, &s)| Segment {
                rows: s..s + it.tokens.len(),
                start_pos: it.start_pos,
                cache: &mut *it.cache,
                verify: false,
            })
            .collect();
        head.layer.forward(&mut h, n, &mut segments, eps, pool)?;
    }
    let mut hidden = vec![0.0f32; n * e];
    for i in 0..n {
        nextn_model::ops::rms_norm(
            &h[i * e..(i + 1) * e],
            &head.shared_head_norm,
            eps,
            &mut hidden[i * e..(i + 1) * e],
        );
    }
    let mut picked = Vec::new();
    let mut ranges = Vec::with_capacity(items.len());
    for (it, &s) in items.iter().zip(&starts) {
        let len = it.tokens.len();
        let (first, count) = match it.logits {
            _ if len == 0 => (0, 0),
            LogitRows::None => (0, 0),
            LogitRows::Last => (len - 1, 1),
            LogitRows::All => (0, len),
        };
        ranges.push((picked.len() / e.max(1), count));
        picked.extend_from_slice(&hidden[(s + first) * e..(s + first + count) * e]);
    }
    let n_picked = picked.len() / e.max(1);
    // Through the draft vocabulary when the head has one (−∞ elsewhere), as `NextnHead::forward`.
    let logits = head.lm_head_logits(&picked, n_picked, pool)?;
    Ok(items
        .iter()
        .zip(&starts)
        .zip(&ranges)
        .map(|((it, &s), &(lr, count))| ForwardOutput {
            hidden: hidden[s * e..(s + it.tokens.len()) * e].to_vec(),
            logits: logits[lr * n_vocab..(lr + count) * n_vocab].to_vec(),
            n_vocab,
        })
        .collect())
}
