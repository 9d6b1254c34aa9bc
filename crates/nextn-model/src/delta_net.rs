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
        // Conv + SiLU over time on a copy of the window (the committed one stays put until commit).
        let mut window = cache.state.conv.clone();
        for t in 0..n {
            let (raw, conv) = (
                &rows.raw[t * conv_dim..(t + 1) * conv_dim],
                &mut rows.conv[t * conv_dim..(t + 1) * conv_dim],
            );
            self.conv_step(raw, &mut window, conv);
            let (q, k) = conv[..2 * key_dim].split_at_mut(key_dim);
            q.chunks_exact_mut(d)
                .for_each(|h| ops::l2_norm(h, self.eps));
            k.chunks_exact_mut(d)
                .for_each(|h| ops::l2_norm(h, self.eps));
            for m in 0..hv {
                rows.beta[t * hv + m] = ops::sigmoid(b[t * hv + m]);
                rows.decay[t * hv + m] =
                    (ops::softplus(alpha[t * hv + m] + self.dt_bias[m]) * self.a[m]).exp();
            }
        }

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

    /// One step of the causal depthwise conv + SiLU; `window` holds the previous `Kc−1` raw inputs
    /// and is shifted to include `m`.
    fn conv_step(&self, m: &[f32], window: &mut [f32], c: &mut [f32]) {
        let conv_dim = m.len();
        let kc = self.kernel;
        for ch in 0..conv_dim {
            let w = &self.conv[ch * kc..(ch + 1) * kc];
            let mut sum = 0.0f32;
            for j in 0..kc - 1 {
                sum += window[j * conv_dim + ch] * w[j];
            }
            sum += m[ch] * w[kc - 1];
            c[ch] = ops::silu(sum);
        }
        if kc > 1 {
            window.copy_within(conv_dim.., 0);
            window[(kc - 2) * conv_dim..].copy_from_slice(m);
        }
    }
}

crate::simd::avx2_and_baseline! {
baseline = delta_rule_step_baseline;
/// One delta-rule step on a head's state `s` (dk × dv, row i = key dim):
/// `S ← decay·S; u = Sᵀk; δ = β(v − u); S += k δᵀ`, and with `readout = (q, o)`, `o = Sᵀq` on the
/// updated state. The state update is the same float sequence with or without the readout.
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
    u.fill(0.0);
    for (i, row) in s.chunks_exact_mut(d).enumerate() {
        let ki = k[i];
        for (sij, uj) in row.iter_mut().zip(u.iter_mut()) {
            *sij *= decay;
            *uj += *sij * ki;
        }
    }
    for (uj, &vj) in u.iter_mut().zip(v) {
        *uj = beta * (vj - *uj);
    }
    match readout {
        Some((q, o)) => {
            o.fill(0.0);
            for (i, row) in s.chunks_exact_mut(d).enumerate() {
                let (ki, qi) = (k[i], q[i]);
                for ((sij, &dj), oj) in row.iter_mut().zip(u.iter()).zip(o.iter_mut()) {
                    *sij += ki * dj;
                    *oj += *sij * qi;
                }
            }
        }
        None => {
            for (i, row) in s.chunks_exact_mut(d).enumerate() {
                let ki = k[i];
                for (sij, &dj) in row.iter_mut().zip(u.iter()) {
                    *sij += ki * dj;
                }
            }
        }
    }
}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy the CPU runs (AVX2 where available) and the baseline copy of the delta rule
    /// give the same bits, with and without the readout.
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
        for d in [16usize, 128, 130] {
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
            }
        }
    }
}
