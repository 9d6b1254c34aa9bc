//! The gated delta net (spec §4.6): causal depthwise conv over the raw q|k|v projection, L2-normalised
//! q/k, per-v-head decay and β, the delta-rule recurrence on a dk×dv state, a gated RMSNorm and the
//! output projection. V head m reads q/k head `m mod Hk` (GGUF's tiled order).

use nextn_quant::kernels::ThreadPool;

use crate::cache::RecurrentState;
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
            conv: w.vector(&p("ssm_conv1d.weight"), &[cfg.conv_kernel as u64, conv_dim as u64])?,
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

    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.head_dim + self.v_heads * self.head_dim
    }

    /// A zero state of the right size for this layer.
    pub fn new_state(&self) -> RecurrentState {
        RecurrentState::zeros(
            (self.kernel - 1) * self.conv_dim(),
            self.v_heads * self.head_dim * self.head_dim,
        )
    }

    /// Process `n` consecutive rows of one sequence, advancing `state` past all of them.
    /// `x` and `out` are `n × n_embd`.
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        state: &mut RecurrentState,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let (hk, hv, d) = (self.k_heads, self.v_heads, self.head_dim);
        let conv_dim = self.conv_dim();
        let key_dim = hk * d;
        let value_dim = hv * d;
        let mut mixed = vec![0.0f32; n * conv_dim];
        let mut z = vec![0.0f32; n * value_dim];
        let mut b = vec![0.0f32; n * hv];
        let mut alpha = vec![0.0f32; n * hv];
        self.w_qkv.forward(x, n, &mut mixed, pool)?;
        self.w_gate.forward(x, n, &mut z, pool)?;
        self.w_beta.forward(x, n, &mut b, pool)?;
        self.w_alpha.forward(x, n, &mut alpha, pool)?;

        let scale = 1.0 / (d as f32).sqrt();
        let mut y = vec![0.0f32; n * value_dim];
        let mut c = vec![0.0f32; conv_dim];
        let mut u = vec![0.0f32; d];
        let mut o = vec![0.0f32; d];
        let mut normed = vec![0.0f32; d];
        for t in 0..n {
            let m = &mixed[t * conv_dim..(t + 1) * conv_dim];
            self.conv_step(m, &mut state.conv, &mut c);
            let (q, rest) = c.split_at_mut(key_dim);
            let (k, v) = rest.split_at_mut(key_dim);
            q.chunks_exact_mut(d).for_each(|h| ops::l2_norm(h, self.eps));
            k.chunks_exact_mut(d).for_each(|h| ops::l2_norm(h, self.eps));

            for mh in 0..hv {
                let g = mh % hk;
                let (qg, kg) = (&q[g * d..(g + 1) * d], &k[g * d..(g + 1) * d]);
                let vm = &v[mh * d..(mh + 1) * d];
                let beta = ops::sigmoid(b[t * hv + mh]);
                let gamma = ops::softplus(alpha[t * hv + mh] + self.dt_bias[mh]) * self.a[mh];
                let decay = gamma.exp();
                let s = &mut state.ssm[mh * d * d..(mh + 1) * d * d];
                // Decay the state and read it with k: u = Sᵀk.
                u.fill(0.0);
                for (i, row) in s.chunks_exact_mut(d).enumerate() {
                    let ki = kg[i];
                    for (sij, uj) in row.iter_mut().zip(u.iter_mut()) {
                        *sij *= decay;
                        *uj += *sij * ki;
                    }
                }
                // δ = β(v − u); S += k δᵀ; o = s·Sᵀq with the updated state.
                for (uj, &vj) in u.iter_mut().zip(vm) {
                    *uj = beta * (vj - *uj);
                }
                o.fill(0.0);
                for (i, row) in s.chunks_exact_mut(d).enumerate() {
                    let (ki, qi) = (kg[i], qg[i]);
                    for ((sij, &dj), oj) in row.iter_mut().zip(u.iter()).zip(o.iter_mut()) {
                        *sij += ki * dj;
                        *oj += *sij * qi;
                    }
                }
                o.iter_mut().for_each(|v| *v *= scale);
                ops::rms_norm(&o, &self.norm, self.eps, &mut normed);
                let zm = &z[t * value_dim + mh * d..][..d];
                let ym = &mut y[t * value_dim + mh * d..][..d];
                for ((yj, &nj), &zj) in ym.iter_mut().zip(&normed).zip(zm) {
                    *yj = nj * ops::silu(zj);
                }
            }
        }
        self.w_out.forward(&y, n, out, pool)
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
