//! Gated full attention (docs/MODEL.md, "Gated full attention"): per-head interleaved query/gate
//! projection, q/k RMSNorm, partial rotary embedding, grouped-query causal softmax attention over
//! the layer's KV cache, and a sigmoid output gate.

use std::sync::Mutex;

use nextn_quant::kernels::ThreadPool;

use crate::cache::{KvLayer, LayerCache};
use crate::config::{Qwen35Config, RopeScaling};
use crate::model::Segment;
use crate::ops::{self, RopeTable};
use crate::weights::{Linear, WeightLoader};
use crate::ModelError;

pub struct GatedAttention {
    /// Output rows per head: `head_dim` query rows then `head_dim` gate rows.
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    n_rot: usize,
    rope_base: f32,
    rope_scale: f32,
    rope_sections: [i32; 4],
    eps: f32,
}

impl GatedAttention {
    /// Bind `blk.{il}.attn_*` for a layer with the given head counts.
    pub fn load(w: &WeightLoader, il: usize, cfg: &Qwen35Config) -> Result<Self, ModelError> {
        let p = |n: &str| format!("blk.{il}.{n}");
        let (n_head, n_head_kv, hd, e) =
            (cfg.n_head[il], cfg.n_head_kv[il], cfg.head_dim, cfg.n_embd);
        Ok(GatedAttention {
            wq: w.linear(&p("attn_q.weight"), 2 * n_head * hd, e)?,
            wk: w.linear(&p("attn_k.weight"), n_head_kv * hd, e)?,
            wv: w.linear(&p("attn_v.weight"), n_head_kv * hd, e)?,
            wo: w.linear(&p("attn_output.weight"), e, n_head * hd)?,
            q_norm: w.vector(&p("attn_q_norm.weight"), &[hd as u64])?,
            k_norm: w.vector(&p("attn_k_norm.weight"), &[hd as u64])?,
            n_head,
            n_head_kv,
            head_dim: hd,
            n_rot: cfg.n_rot,
            rope_base: cfg.rope_freq_base,
            rope_scale: match cfg.rope_scaling {
                RopeScaling::None => 1.0,
                RopeScaling::Linear { freq_scale } => freq_scale,
            },
            rope_sections: cfg.rope_sections,
            eps: cfg.rms_eps,
        })
    }

    /// Attend the rows of every segment (each one sequence's consecutive rows, at positions
    /// `start_pos..`), appending their keys and values to that sequence's cache. The projections
    /// run once over all `n` rows; attention runs per sequence. `x` and `out` are `n × n_embd`.
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        segments: &mut [Segment],
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let hd = self.head_dim;
        let (q_width, kv_width) = (2 * self.n_head * hd, self.n_head_kv * hd);
        let mut qg = vec![0.0f32; n * q_width];
        let mut k = vec![0.0f32; n * kv_width];
        let mut v = vec![0.0f32; n * kv_width];
        self.wq.forward(x, n, &mut qg, pool)?;
        self.wk.forward(x, n, &mut k, pool)?;
        self.wv.forward(x, n, &mut v, pool)?;

        let mut attn = vec![0.0f32; n * self.n_head * hd];
        for seg in segments.iter_mut() {
            let LayerCache::Attention(kv) = &mut *seg.cache else {
                return Err(ModelError::WrongCacheKind {
                    layer: "attention",
                    found: "delta-net",
                });
            };
            let r = seg.rows.clone();
            self.attend(
                &qg[r.start * q_width..r.end * q_width],
                &mut k[r.start * kv_width..r.end * kv_width],
                &v[r.start * kv_width..r.end * kv_width],
                seg.start_pos,
                kv,
                &mut attn[r.start * self.n_head * hd..r.end * self.n_head * hd],
                pool,
            )?;
        }
        self.wo.forward(&attn, n, out, pool)
    }

    /// One sequence's rows: q/k norms, RoPE, cache append, causal softmax attention, output gate.
    fn attend(
        &self,
        qg: &[f32],
        k: &mut [f32],
        v: &[f32],
        start_pos: usize,
        kv: &mut KvLayer,
        attn: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        if kv.len() != start_pos {
            return Err(ModelError::CachePosition {
                layer: "attention",
                cached: kv.len(),
                start: start_pos,
            });
        }
        let hd = self.head_dim;
        let (q_width, kv_width) = (2 * self.n_head * hd, self.n_head_kv * hd);
        let n = qg.len() / q_width;
        // Queries de-interleaved to [row][head][hd]; gates kept aside.
        let mut q = vec![0.0f32; n * self.n_head * hd];
        let mut gate = vec![0.0f32; n * self.n_head * hd];
        for i in 0..n {
            let rope = RopeTable::new(
                start_pos + i,
                self.n_rot,
                self.rope_base,
                self.rope_scale,
                self.rope_sections,
            );
            for h in 0..self.n_head {
                let src = &qg[i * q_width + h * 2 * hd..];
                let dst = (i * self.n_head + h) * hd;
                q[dst..dst + hd].copy_from_slice(&src[..hd]);
                gate[dst..dst + hd].copy_from_slice(&src[hd..2 * hd]);
            }
            let qi = &mut q[i * self.n_head * hd..(i + 1) * self.n_head * hd];
            ops::rms_norm_heads(qi, &self.q_norm, self.eps);
            qi.chunks_exact_mut(hd).for_each(|head| rope.apply(head));
            let ki = &mut k[i * kv_width..(i + 1) * kv_width];
            ops::rms_norm_heads(ki, &self.k_norm, self.eps);
            ki.chunks_exact_mut(hd).for_each(|head| rope.apply(head));
            kv.push(ki, &v[i * kv_width..(i + 1) * kv_width]);
        }

        // Causal attention: row i sees positions 0..=start_pos+i. Each (row, head) is computed
        // alone, so its result depends neither on the batch it came in nor on the task split.
        // Tasks are (KV group, block of rows): a group's heads share one f32 copy of its keys
        // and values, and a prefill's rows spread over the pool even when groups are few.
        let group = self.n_head / self.n_head_kv;
        let row_blocks = pool.n_threads().div_ceil(self.n_head_kv).min(n).max(1);
        let rows_per_block = n.div_ceil(row_blocks);
        let n_tasks = self.n_head_kv * row_blocks;
        let outputs: Vec<Mutex<Vec<f32>>> = (0..n_tasks).map(|_| Mutex::new(Vec::new())).collect();
        let (q, kv_ref) = (&q, &*kv);
        pool.run(n_tasks, |task, _| {
            let (g, block) = (task / row_blocks, task % row_blocks);
            let rows = block * rows_per_block..((block + 1) * rows_per_block).min(n);
            if rows.is_empty() {
                return;
            }
            let visible = start_pos + rows.end;
            let (mut keys, mut vals) = (Vec::new(), Vec::new());
            kv_ref.read_head(false, g, hd, visible, &mut keys);
            kv_ref.read_head(true, g, hd, visible, &mut vals);
            let mut out = outputs[task].lock().unwrap_or_else(|e| e.into_inner());
            out.resize(rows.len() * group * hd, 0.0);
            // Rows go in blocks so that each tile of keys and values is read from cache by all
            // the block's queries; every query still sees its positions in ascending order.
            let first = rows.start;
            let rows: Vec<usize> = rows.collect();
            let mut scores = Vec::new();
            for block in rows.chunks(QUERY_BLOCK_ROWS) {
                let queries: Vec<(usize, &[f32])> = block
                    .iter()
                    .flat_map(|&i| {
                        (g * group..(g + 1) * group).map(move |h| {
                            (start_pos + i + 1, &q[(i * self.n_head + h) * hd..][..hd])
                        })
                    })
                    .collect();
                let o_first = (block[0] - first) * group * hd;
                let o = &mut out[o_first..o_first + queries.len() * hd];
                attend_tiled(&queries, &keys, &vals, hd, &mut scores, o);
            }
        });
        for (task, out) in outputs.into_iter().enumerate() {
            let (g, block) = (task / row_blocks, task % row_blocks);
            let out = out.into_inner().unwrap_or_else(|e| e.into_inner());
            let first = block * rows_per_block;
            for (r, row_heads) in out.chunks_exact(group * hd).enumerate() {
                let dst = ((first + r) * self.n_head + g * group) * hd;
                attn[dst..dst + group * hd].copy_from_slice(row_heads);
            }
        }
        for (a, &g) in attn.iter_mut().zip(&gate) {
            *a *= ops::sigmoid(g);
        }
        Ok(())
    }
}

/// Rows per block of queries in one tiled attention pass.
const QUERY_BLOCK_ROWS: usize = 8;
/// Cached positions per tile: 64 positions × 256 dims × 4 bytes = 64 KiB of keys or values.
const KEY_TILE: usize = 64;

crate::wide::avx2_and_baseline! {
baseline = attend_tiled_baseline;
/// Softmax attention of several query heads, each `(len, q)` over the first `len` cached
/// positions, into `o` (`queries.len() × hd`). Key and value tiles are shared by all queries.
/// For each query the arithmetic is that of a lone query: scores `q·k_p · scale` in position
/// order, one softmax over its `len` scores, then `o += s_p·v_p` for p ascending.
fn attend_tiled(
    queries: &[(usize, &[f32])],
    keys: &[f32],
    vals: &[f32],
    hd: usize,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    let scale = 1.0 / (hd as f32).sqrt();
    let max_len = queries.iter().map(|&(len, _)| len).max().unwrap_or(0);
    scores.clear();
    scores.resize(queries.len() * max_len, 0.0);
    for tile in (0..max_len).step_by(KEY_TILE) {
        for (j, &(len, qh)) in queries.iter().enumerate() {
            let s = &mut scores[j * max_len..][..len];
            let end = (tile + KEY_TILE).min(len);
            let key = |p: usize| &keys[p * hd..(p + 1) * hd];
            let mut p = tile;
            // Four keys per pass over the query: a quarter of the query loads.
            while p + 4 <= end {
                let d = dot_x4(qh, [key(p), key(p + 1), key(p + 2), key(p + 3)]);
                for (r, dr) in d.into_iter().enumerate() {
                    s[p + r] = dr * scale;
                }
                p += 4;
            }
            for (p, sp) in s.iter_mut().enumerate().take(end).skip(p) {
                *sp = ops::dot(qh, key(p)) * scale;
            }
        }
    }
    for (j, &(len, _)) in queries.iter().enumerate() {
        ops::softmax(&mut scores[j * max_len..][..len]);
    }
    o.fill(0.0);
    for tile in (0..max_len).step_by(KEY_TILE) {
        for (j, &(len, _)) in queries.iter().enumerate() {
            let end = (tile + KEY_TILE).min(len);
            if end > tile {
                let s = &scores[j * max_len + tile..j * max_len + end];
                add_weighted_values(s, &vals[tile * hd..end * hd], &mut o[j * hd..(j + 1) * hd]);
            }
        }
    }
}
}

/// `ops::dot(q, k[r])` for four keys at once, each with exactly `ops::dot`'s operations
/// (eight lane sums over chunks of eight, the same pairwise reduction, then the tail).
#[inline(always)]
fn dot_x4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len();
    let chunks = n / 8;
    let mut acc = [[0.0f32; 8]; 4];
    for c in 0..chunks {
        let qc = &q[c * 8..c * 8 + 8];
        for (a, kr) in acc.iter_mut().zip(&k) {
            let kc = &kr[c * 8..c * 8 + 8];
            for l in 0..8 {
                a[l] += qc[l] * kc[l];
            }
        }
    }
    core::array::from_fn(|r| {
        let a = &acc[r];
        let mut s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
        for i in chunks * 8..n {
            s += q[i] * k[r][i];
        }
        s
    })
}

/// `o += Σ_p s[p]·v_p` over consecutive value rows `v` (`s.len()` rows of `o.len()`), each
/// element adding its terms in ascending p as a row-by-row loop would. Sixteen columns at a
/// time stay in registers across all the rows, so `o` is read and written once per call
/// rather than once per row.
#[inline(always)]
fn add_weighted_values(s: &[f32], v: &[f32], o: &mut [f32]) {
    let hd = o.len();
    let wide = hd / 16 * 16;
    for c in (0..wide).step_by(16) {
        let mut acc = [0.0f32; 16];
        acc.copy_from_slice(&o[c..c + 16]);
        for (p, &sp) in s.iter().enumerate() {
            let vp = &v[p * hd + c..p * hd + c + 16];
            for l in 0..16 {
                acc[l] += sp * vp[l];
            }
        }
        o[c..c + 16].copy_from_slice(&acc);
    }
    for (p, &sp) in s.iter().enumerate() {
        for d in wide..hd {
            o[d] += sp * v[p * hd + d];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy the CPU runs (AVX2 where available) and the baseline copy of tiled attention
    /// give the same bits, for queries of different lengths across several key tiles.
    #[test]
    fn attention_copies_agree_bit_for_bit() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for hd in [64usize, 256, 100] {
            let n_pos = 3 * KEY_TILE + 5;
            let keys: Vec<f32> = (0..n_pos * hd).map(|_| next()).collect();
            let vals: Vec<f32> = (0..n_pos * hd).map(|_| next()).collect();
            let qs: Vec<Vec<f32>> = (0..5).map(|_| (0..hd).map(|_| next()).collect()).collect();
            let lens = [1, KEY_TILE, KEY_TILE + 1, n_pos - 1, n_pos];
            let queries: Vec<(usize, &[f32])> =
                lens.iter().zip(&qs).map(|(&l, q)| (l, &q[..])).collect();
            let (mut o_a, mut o_b) = (vec![0.0; 5 * hd], vec![0.0; 5 * hd]);
            let (mut sc_a, mut sc_b) = (Vec::new(), Vec::new());
            attend_tiled(&queries, &keys, &vals, hd, &mut sc_a, &mut o_a);
            attend_tiled_baseline(&queries, &keys, &vals, hd, &mut sc_b, &mut o_b);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&o_a), bits(&o_b), "head dim {hd}");
            // And both are a lone query's plain loops, bit for bit.
            for (j, &(len, q)) in queries.iter().enumerate() {
                let mut s: Vec<f32> = (0..len)
                    .map(|p| ops::dot(q, &keys[p * hd..(p + 1) * hd]) * (1.0 / (hd as f32).sqrt()))
                    .collect();
                ops::softmax(&mut s);
                let mut o = vec![0.0f32; hd];
                for (p, &sp) in s.iter().enumerate() {
                    for d in 0..hd {
                        o[d] += sp * vals[p * hd + d];
                    }
                }
                assert_eq!(
                    bits(&o),
                    bits(&o_a[j * hd..(j + 1) * hd]),
                    "query {j}, head dim {hd}"
                );
            }
        }
    }
}
