//! The gated delta net (docs/MODEL.md, "Gated delta-net"): causal depthwise conv over the raw
//! q|k|v projection, L2-normalised q/k, per-v-head decay and β, the delta-rule recurrence on a
//! dk×dv state, a gated RMSNorm and the output projection. V head m reads q/k head `m mod Hk`
//! (GGUF's tiled order).

use std::sync::Mutex;

use nextn_quant::kernels::ThreadPool;

use crate::batch::Segment;
use crate::cache::{DeltaNetCache, LayerCache, RecurrentState, RowInputs};
use crate::config::Qwen35Config;
use crate::ops;
use crate::weights::{Linear, WeightLoader};
use crate::ModelError;

pub struct GatedDeltaNet {
    /// `conv_dim × n_embd`: [q (key_dim) | k (key_dim) | v (value_dim)].
    pub w_qkv: Linear,
    /// Output gate z: `value_dim × n_embd`.
    pub w_gate: Linear,
    pub w_beta: Linear,
    pub w_alpha: Linear,
    /// `conv_dim × Kc`, element 0 the oldest tap.
    pub conv: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// A = −exp(A_log), already negative in the file.
    pub a: Vec<f32>,
    /// Gated-norm weight (no +1: stored as trained).
    pub norm: Vec<f32>,
    pub w_out: Linear,
    k_heads: usize,
    v_heads: usize,
    head_dim: usize,
    kernel: usize,
    eps: f32,
}

impl GatedDeltaNet {
    pub fn load(w: &WeightLoader, il: usize, cfg: &Qwen35Config) -> Result<Self, ModelError> {
        let p = |n: &str| format!("blk.{il}.{n}");
        let (e, hv, dk) = (cfg.n_embd, cfg.ssm_v_heads, cfg.ssm_head_dim);
        let conv_dim = cfg.conv_dim();
        Ok(GatedDeltaNet {
            w_qkv: w.linear(&p("attn_qkv.weight"), conv_dim, e)?,
            w_gate: w.linear(&p("attn_gate.weight"), cfg.ssm_inner, e)?,
            w_beta: w.linear(&p("ssm_beta.weight"), hv, e)?,
            w_alpha: w.linear(&p("ssm_alpha.weight"), hv, e)?,
            conv: w.vector(
                &p("ssm_conv1d.weight"),
                &[cfg.conv_kernel as u64, conv_dim as u64],
            )?,
            dt_bias: w.vector(&p("ssm_dt.bias"), &[hv as u64])?,
            a: w.vector(&p("ssm_a"), &[hv as u64])?,
            norm: w.vector(&p("ssm_norm.weight"), &[dk as u64])?,
            w_out: w.linear(&p("ssm_out.weight"), e, cfg.ssm_inner)?,
            k_heads: cfg.ssm_k_heads,
            v_heads: hv,
            head_dim: dk,
            kernel: cfg.conv_kernel,
            eps: cfg.rms_eps,
        })
    }

    /// `(k heads, v heads, head dim, conv kernel, eps)`.
    pub fn shape(&self) -> (usize, usize, usize, usize, f32) {
        (
            self.k_heads,
            self.v_heads,
            self.head_dim,
            self.kernel,
            self.eps,
        )
    }

    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.head_dim + self.v_heads * self.head_dim
    }

    /// A zero state of the right size for this layer.
    pub fn new_cache(&self) -> DeltaNetCache {
        DeltaNetCache {
            state: RecurrentState::zeros(
                (self.kernel - 1) * self.conv_dim(),
                self.v_heads * self.head_dim * self.head_dim,
            ),
            spare: Vec::new(),
            pending: None,
        }
    }

    /// Process the rows of every segment (each one sequence's consecutive rows). The projections
    /// run once over all `n` rows; the conv and the recurrence run per sequence on its own cache.
    /// A segment with `verify` false commits its rows at once; with `verify` true the committed
    /// state is left as it was, the state after the last row goes to a spare buffer and each row's
    /// inputs to the recurrence are kept, so [`GatedDeltaNet::commit`] can keep any prefix of the
    /// rows: all of them by swapping buffers, fewer by replaying only the kept rows.
    /// `x` and `out` are `n × n_embd`.
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        segments: &mut [Segment],
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let hv = self.v_heads;
        let conv_dim = self.conv_dim();
        let value_dim = hv * self.head_dim;
        let mut raw = vec![0.0f32; n * conv_dim];
        let mut z = vec![0.0f32; n * value_dim];
        let mut b = vec![0.0f32; n * hv];
        let mut alpha = vec![0.0f32; n * hv];
        self.w_qkv.forward(x, n, &mut raw, pool)?;
        self.w_gate.forward(x, n, &mut z, pool)?;
        self.w_beta.forward(x, n, &mut b, pool)?;
        self.w_alpha.forward(x, n, &mut alpha, pool)?;
        let mut y = vec![0.0f32; n * value_dim];
        for seg in segments.iter_mut() {
            let LayerCache::DeltaNet(cache) = &mut *seg.cache else {
                return Err(ModelError::WrongCacheKind {
                    layer: "delta-net",
                    found: "attention",
                });
            };
            let r = seg.rows.clone();
            self.recur(
                &raw[r.start * conv_dim..r.end * conv_dim],
                &z[r.start * value_dim..r.end * value_dim],
                &b[r.start * hv..r.end * hv],
                &alpha[r.start * hv..r.end * hv],
                cache,
                seg.verify,
                &mut y[r.start * value_dim..r.end * value_dim],
                pool,
            )?;
        }
        self.w_out.forward(&y, n, out, pool)
    }

    /// Conv, recurrence and gated norm for one sequence's rows.
    #[allow(clippy::too_many_arguments)]
    fn recur(
        &self,
        raw: &[f32],
        z: &[f32],
        b: &[f32],
        alpha: &[f32],
        cache: &mut DeltaNetCache,
        verify: bool,
        y: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        if let Some(rows) = &cache.pending {
            return Err(ModelError::UncommittedVerify { pending: rows.n });
        }
        let (hk, hv, d) = (self.k_heads, self.v_heads, self.head_dim);
        let conv_dim = self.conv_dim();
        let key_dim = hk * d;
        let value_dim = hv * d;
        let n = raw.len() / conv_dim;
        let mut rows = RowInputs::new(n, conv_dim, hv);
        rows.raw.copy_from_slice(raw);
        // Conv + SiLU over time: row t reads the raw inputs t..t+Kc of [window, rows] (the
        // committed window stays put until commit), never another row's output, so the rows go
        // over the pool in ranges with the arithmetic of one row at a time.
        let mut history = Vec::with_capacity(cache.state.conv.len() + raw.len());
        history.extend_from_slice(&cache.state.conv);
        history.extend_from_slice(raw);
        let per_task = n.div_ceil(pool.n_threads()).max(1);
        type RowRange<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32]);
        let ranges: Vec<Mutex<RowRange>> = rows
            .conv
            .chunks_mut(per_task * conv_dim)
            .zip(rows.beta.chunks_mut(per_task * hv))
            .zip(rows.decay.chunks_mut(per_task * hv))
            .map(|((c, beta), decay)| Mutex::new((c, beta, decay)))
            .collect();
        let history_ref = &history;
        pool.run(ranges.len(), |task, _| {
            let mut range = ranges[task].lock().unwrap_or_else(|e| e.into_inner());
            let (conv, beta, decay) = &mut *range;
            for (i, c) in conv.chunks_exact_mut(conv_dim).enumerate() {
                let t = task * per_task + i;
                self.conv_row(&history_ref[t * conv_dim..(t + self.kernel) * conv_dim], c);
                let (q, k) = c[..2 * key_dim].split_at_mut(key_dim);
                q.chunks_exact_mut(d)
                    .for_each(|h| ops::l2_norm(h, self.eps));
                k.chunks_exact_mut(d)
                    .for_each(|h| ops::l2_norm(h, self.eps));
                for m in 0..hv {
                    beta[i * hv + m] = ops::sigmoid(b[t * hv + m]);
                    decay[i * hv + m] =
                        (ops::softplus(alpha[t * hv + m] + self.dt_bias[m]) * self.a[m]).exp();
                }
            }
        });
        drop(ranges);
        // The window after the rows: their last Kc−1 raw inputs (with the old window's).
        let window = history[n * conv_dim..].to_vec();

        let scale = 1.0 / (d as f32).sqrt();
        if verify {
            cache.spare.resize(cache.state.ssm.len(), 0.0);
        }
        // Heads are independent: spread them over the pool. Each head's arithmetic is the same
        // whichever thread runs it, so results do not depend on the thread count.
        // In verify mode each head's task first copies its committed state into the spare and
        // runs there: the copy is spread over the pool and leaves the head's 64 KiB in cache for
        // the rows that follow.
        type HeadState<'a> = (Option<&'a [f32]>, &'a mut [f32]);
        let states: Vec<Mutex<HeadState>> = if verify {
            let (src, dst) = (&cache.state.ssm, &mut cache.spare);
            src.chunks(d * d)
                .zip(dst.chunks_mut(d * d))
                .map(|(s, t)| Mutex::new((Some(s), t)))
                .collect()
        } else {
            cache
                .state
                .ssm
                .chunks_mut(d * d)
                .map(|t| Mutex::new((None, t)))
                .collect()
        };
        let outputs: Vec<Mutex<Vec<f32>>> =
            (0..hv).map(|_| Mutex::new(vec![0.0f32; n * d])).collect();
        let rows_ref = &rows;
        pool.run(hv, |mh, _| {
            let g = mh % hk;
            let mut head = states[mh].lock().unwrap_or_else(|e| e.into_inner());
            let (committed, s) = &mut *head;
            if let Some(src) = committed {
                s.copy_from_slice(src);
            }
            let mut yh = outputs[mh].lock().unwrap_or_else(|e| e.into_inner());
            let mut u = vec![0.0f32; d];
            let mut o = vec![0.0f32; d];
            let mut normed = vec![0.0f32; d];
            for t in 0..n {
                let c = &rows_ref.conv[t * conv_dim..(t + 1) * conv_dim];
                let (qg, kg) = (
                    &c[g * d..(g + 1) * d],
                    &c[key_dim + g * d..key_dim + (g + 1) * d],
                );
                let vm = &c[2 * key_dim + mh * d..2 * key_dim + (mh + 1) * d];
                delta_rule_step(
                    s,
                    kg,
                    vm,
                    rows_ref.beta[t * hv + mh],
                    rows_ref.decay[t * hv + mh],
                    &mut u,
                    Some((qg, &mut o)),
                );
                o.iter_mut().for_each(|v| *v *= scale);
                ops::rms_norm(&o, &self.norm, self.eps, &mut normed);
                let zm = &z[t * value_dim + mh * d..][..d];
                for ((yj, &nj), &zj) in yh[t * d..(t + 1) * d].iter_mut().zip(&normed).zip(zm) {
                    *yj = nj * ops::silu(zj);
                }
            }
        });
        drop(states);
        for (mh, out) in outputs.into_iter().enumerate() {
            let yh = out.into_inner().unwrap_or_else(|e| e.into_inner());
            for t in 0..n {
                y[t * value_dim + mh * d..t * value_dim + (mh + 1) * d]
                    .copy_from_slice(&yh[t * d..(t + 1) * d]);
            }
        }
        if verify {
            cache.pending = Some(rows);
        } else {
            cache.state.conv = window;
        }
        Ok(())
    }

    /// Keep the first `keep` rows of the pending verify batch (0 drops them all).
    pub fn commit(&self, cache: &mut DeltaNetCache, keep: usize) -> Result<(), ModelError> {
        let Some(rows) = cache.pending.take() else {
            return if keep == 0 {
                Ok(())
            } else {
                Err(ModelError::KeepBeyondPending { keep, pending: 0 })
            };
        };
        if keep > rows.n {
            return Err(ModelError::KeepBeyondPending {
                keep,
                pending: rows.n,
            });
        }
        let (hk, hv, d) = (self.k_heads, self.v_heads, self.head_dim);
        let conv_dim = self.conv_dim();
        let key_dim = hk * d;
        if keep == rows.n {
            std::mem::swap(&mut cache.state.ssm, &mut cache.spare);
        } else if keep > 0 {
            // Replay only the kept rows on the committed state: the same arithmetic as the forward
            // pass, so the result is bit-identical to having decoded those rows alone.
            let mut u = vec![0.0f32; d];
            for mh in 0..hv {
                let g = mh % hk;
                let s = &mut cache.state.ssm[mh * d * d..(mh + 1) * d * d];
                for t in 0..keep {
                    let c = &rows.conv[t * conv_dim..(t + 1) * conv_dim];
                    let kg = &c[key_dim + g * d..key_dim + (g + 1) * d];
                    let vm = &c[2 * key_dim + mh * d..2 * key_dim + (mh + 1) * d];
                    delta_rule_step(
                        s,
                        kg,
                        vm,
                        rows.beta[t * hv + mh],
                        rows.decay[t * hv + mh],
                        &mut u,
                        None,
                    );
                }
            }
        }
        // The conv window after `keep` rows: the last Kc−1 raw inputs of [window, kept rows].
        let kc1 = self.kernel - 1;
        if keep > 0 && kc1 > 0 {
            let mut all = std::mem::take(&mut cache.state.conv);
            all.extend_from_slice(&rows.raw[..keep * conv_dim]);
            cache.state.conv = all[all.len() - kc1 * conv_dim..].to_vec();
        }
        Ok(())
    }

    /// One row of the causal depthwise conv + SiLU: `taps` holds the row's `Kc` raw inputs, the
    /// oldest first (the last is the row's own), each `conv_dim` wide.
    fn conv_row(&self, taps: &[f32], c: &mut [f32]) {
        let conv_dim = c.len();
        let kc = self.kernel;
        for (ch, out) in c.iter_mut().enumerate() {
            let w = &self.conv[ch * kc..(ch + 1) * kc];
            let mut sum = 0.0f32;
            for (j, &wj) in w.iter().enumerate() {
                sum += taps[j * conv_dim + ch] * wj;
            }
            *out = ops::silu(sum);
        }
    }
}

/// Columns of the state handled per sweep over its rows in [`delta_rule_step`]: their running
/// sums stay in registers for the whole sweep (four 8-lane registers with AVX2).
const COLUMN_BLOCK: usize = 32;

crate::simd::avx2_and_baseline! {
baseline = delta_rule_step_baseline;
/// One delta-rule step on a head's state `s` (dk × dv, row i = key dim):
/// `S ← decay·S; u = Sᵀk; δ = β(v − u); S += k δᵀ`, and with `readout = (q, o)`, `o = Sᵀq` on the
/// updated state. The state update is the same float sequence with or without the readout.
///
/// Each sum `u_j` (and `o_j`) adds its terms in ascending row order from zero, as a row-by-row
/// loop does; the columns go in blocks of [`COLUMN_BLOCK`] so that a block's sums are kept in
/// registers across the sweep over the rows instead of being stored and reloaded for every
/// row (a chain through memory that held every step to the store-to-load latency).
fn delta_rule_step(
    s: &mut [f32],
    k: &[f32],
    v: &[f32],
    beta: f32,
    decay: f32,
    u: &mut [f32],
    readout: Option<(&[f32], &mut [f32])>,
) {
    let d = u.len();
    for (c, u) in (0..d).step_by(COLUMN_BLOCK).zip(u.chunks_mut(COLUMN_BLOCK)) {
        if u.len() == COLUMN_BLOCK {
            u.copy_from_slice(&decay_and_key_sums::<COLUMN_BLOCK>(s, d, c, k, decay));
        } else {
            // The last columns (d not a multiple of the block): one at a time.
            for (j, uj) in u.iter_mut().enumerate() {
                *uj = decay_and_key_sums::<1>(s, d, c + j, k, decay)[0];
            }
        }
    }
    for (uj, &vj) in u.iter_mut().zip(v) {
        *uj = beta * (vj - *uj);
    }
    match readout {
        Some((q, o)) => {
            for (c, o) in (0..d).step_by(COLUMN_BLOCK).zip(o.chunks_mut(COLUMN_BLOCK)) {
                if o.len() == COLUMN_BLOCK {
                    o.copy_from_slice(&update_and_read::<COLUMN_BLOCK>(s, d, c, k, u, q));
                } else {
                    for (j, oj) in o.iter_mut().enumerate() {
                        *oj = update_and_read::<1>(s, d, c + j, k, u, q)[0];
                    }
                }
            }
        }
        None => {
            for (row, &ki) in s.chunks_exact_mut(d).zip(k) {
                for (sij, &dj) in row.iter_mut().zip(u.iter()) {
                    *sij += ki * dj;
                }
            }
        }
    }
}
}

/// Columns `c..c + N` of the state (`d` wide): `S ← decay·S` there and `Σ_i S_ij·k_i` of each,
/// added from zero in ascending row order, the `N` sums held in registers across the rows.
#[inline(always)]
fn decay_and_key_sums<const N: usize>(
    s: &mut [f32],
    d: usize,
    c: usize,
    k: &[f32],
    decay: f32,
) -> [f32; N] {
    let mut acc = [0.0f32; N];
    for (row, &ki) in s.chunks_exact_mut(d).zip(k) {
        let seg: &mut [f32; N] = (&mut row[c..c + N]).try_into().expect("N columns");
        for (sij, a) in seg.iter_mut().zip(acc.iter_mut()) {
            *sij *= decay;
            *a += *sij * ki;
        }
    }
    acc
}

/// Columns `c..c + N` of the state: `S += k δᵀ` there and `Σ_i S_ij·q_i` of each on the updated
/// state, added from zero in ascending row order, the `N` sums held in registers.
#[inline(always)]
fn update_and_read<const N: usize>(
    s: &mut [f32],
    d: usize,
    c: usize,
    k: &[f32],
    delta: &[f32],
    q: &[f32],
) -> [f32; N] {
    let delta: &[f32; N] = delta[c..c + N].try_into().expect("N columns");
    let mut acc = [0.0f32; N];
    for ((row, &ki), &qi) in s.chunks_exact_mut(d).zip(k).zip(q) {
        let seg: &mut [f32; N] = (&mut row[c..c + N]).try_into().expect("N columns");
        for ((sij, &dj), a) in seg.iter_mut().zip(delta).zip(acc.iter_mut()) {
            *sij += ki * dj;
            *a += *sij * qi;
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The delta rule as plain row-by-row loops over a `d × d` state: every sum over the rows
    /// from zero in ascending row order. Returns the new state and the readout.
    fn delta_rule_row_by_row(
        s0: &[f32],
        k: &[f32],
        v: &[f32],
        beta: f32,
        decay: f32,
        q: &[f32],
        d: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut s = s0.to_vec();
        let mut u = vec![0.0f32; d];
        for i in 0..d {
            for j in 0..d {
                s[i * d + j] *= decay;
                u[j] += s[i * d + j] * k[i];
            }
        }
        let delta: Vec<f32> = (0..d).map(|j| beta * (v[j] - u[j])).collect();
        let mut o = vec![0.0f32; d];
        for i in 0..d {
            for j in 0..d {
                s[i * d + j] += k[i] * delta[j];
                o[j] += s[i * d + j] * q[i];
            }
        }
        (s, o)
    }

    /// The copy the CPU runs (AVX2 where available) and the baseline copy of the delta rule
    /// give the same bits, with and without the readout, and the bits of the row-by-row loops.
    #[test]
    fn delta_rule_copies_agree_bit_for_bit() {
        crate::simd::report_missing_avx2("the AVX2 copy of the delta rule");
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for d in [16usize, 32, 128, 130] {
            let s0: Vec<f32> = (0..d * d).map(|_| next()).collect();
            let (k, v, q): (Vec<f32>, Vec<f32>, Vec<f32>) = (
                (0..d).map(|_| next()).collect(),
                (0..d).map(|_| next()).collect(),
                (0..d).map(|_| next()).collect(),
            );
            for readout in [false, true] {
                let (mut s_a, mut s_b) = (s0.clone(), s0.clone());
                let (mut u_a, mut u_b) = (vec![0.0; d], vec![0.0; d]);
                let (mut o_a, mut o_b) = (vec![0.0; d], vec![0.0; d]);
                let (ro_a, ro_b) = if readout {
                    (Some((&q[..], &mut o_a[..])), Some((&q[..], &mut o_b[..])))
                } else {
                    (None, None)
                };
                delta_rule_step(&mut s_a, &k, &v, 0.7, 0.93, &mut u_a, ro_a);
                delta_rule_step_baseline(&mut s_b, &k, &v, 0.7, 0.93, &mut u_b, ro_b);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&s_a), bits(&s_b), "state, d = {d}");
                assert_eq!(bits(&o_a), bits(&o_b), "readout, d = {d}");
                // And both are the row-by-row loops of the formula, bit for bit.
                let (s_r, o_r) = delta_rule_row_by_row(&s0, &k, &v, 0.7, 0.93, &q, d);
                assert_eq!(bits(&s_a), bits(&s_r), "state against row by row, d = {d}");
                if readout {
                    assert_eq!(
                        bits(&o_a),
                        bits(&o_r),
                        "readout against row by row, d = {d}"
                    );
                }
            }
        }
    }
}
