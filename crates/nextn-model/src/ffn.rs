//! Feed-forward blocks: dense SwiGLU (docs/MODEL.md, "Dense SwiGLU") and the routed mixture of
//! experts with a sigmoid-gated shared expert (docs/MODEL.md, "Mixture of experts with shared
//! expert").

use std::sync::atomic::{AtomicU64, Ordering};

use nextn_quant::kernels::ThreadPool;

use crate::config::{Arch, Qwen35Config};
use crate::ops;
use crate::weights::{Linear, WeightLoader};
use crate::ModelError;

/// 2^-14, the smallest normal f16: llama.cpp clamps the sum of the chosen experts' weights to it before
/// normalising them.
const F16_MIN_NORMAL: f32 = 6.103_515_6e-5;

/// `W_down · (SiLU(W_gate·x) ⊙ (W_up·x))`.
pub struct DenseFfn {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl DenseFfn {
    fn load(
        w: &WeightLoader,
        prefix: &str,
        n_embd: usize,
        n_ff: usize,
    ) -> Result<Self, ModelError> {
        Ok(DenseFfn {
            gate: w.linear(&format!("{prefix}_gate{}", ".weight"), n_ff, n_embd)?,
            up: w.linear(&format!("{prefix}_up{}", ".weight"), n_ff, n_embd)?,
            down: w.linear(&format!("{prefix}_down{}", ".weight"), n_embd, n_ff)?,
        })
    }

    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let n_ff = self.gate.rows;
        let mut g = vec![0.0f32; n * n_ff];
        let mut u = vec![0.0f32; n * n_ff];
        self.gate.forward(x, n, &mut g, pool)?;
        self.up.forward(x, n, &mut u, pool)?;
        g.iter_mut()
            .zip(&u)
            .for_each(|(a, &b)| *a = ops::silu(*a) * b);
        self.down.forward(&g, n, out, pool)
    }
}

/// Which experts of a layer had their weights read since the last [`ExpertUsage::reset`], and
/// how many expert weight passes that took, so a benchmark can count the bytes a pass streamed.
/// Recording costs two relaxed atomic operations per distinct expert per pass.
pub struct ExpertUsage {
    touched: Vec<AtomicU64>,
    weight_reads: AtomicU64,
}

impl ExpertUsage {
    pub fn new(n_expert: usize) -> Self {
        ExpertUsage {
            touched: (0..n_expert.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            weight_reads: AtomicU64::new(0),
        }
    }

    fn record(&self, expert: usize) {
        self.touched[expert / 64].fetch_or(1 << (expert % 64), Ordering::Relaxed);
        self.weight_reads.fetch_add(1, Ordering::Relaxed);
    }

    /// Ids of the experts read since the last reset, ascending.
    pub fn touched(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for (w, word) in self.touched.iter().enumerate() {
            let mut bits = word.load(Ordering::Relaxed);
            while bits != 0 {
                out.push(w * 64 + bits.trailing_zeros() as usize);
                bits &= bits - 1;
            }
        }
        out
    }

    /// Expert weight passes since the last reset: one per expert per forward pass that chose it,
    /// however many rows chose it.
    pub fn weight_reads(&self) -> u64 {
        self.weight_reads.load(Ordering::Relaxed)
    }

    pub fn reset(&self) {
        self.touched
            .iter()
            .for_each(|w| w.store(0, Ordering::Relaxed));
        self.weight_reads.store(0, Ordering::Relaxed);
    }
}

/// Experts of one layer: each `Linear` is one expert's matrix inside the stacked tensor.
pub struct MoeFfn {
    pub router: Linear,
    pub gate: Vec<Linear>,
    pub up: Vec<Linear>,
    pub down: Vec<Linear>,
    pub n_used: usize,
    pub shared: Option<(Linear, DenseFfn)>,
    pub usage: ExpertUsage,
}

impl MoeFfn {
    fn load(w: &WeightLoader, il: usize, cfg: &Qwen35Config) -> Result<Self, ModelError> {
        let p = |n: &str| format!("blk.{il}.{n}");
        let (e, ne, nf) = (cfg.n_embd, cfg.n_expert, cfg.n_ff_exp);
        let (gate, up) = if w.has(&p("ffn_gate_up_exps.weight")) {
            let fused = w.experts(&p("ffn_gate_up_exps.weight"), ne, 2 * nf, e)?;
            (
                WeightLoader::split_rows(&fused, 0, nf),
                WeightLoader::split_rows(&fused, nf, nf),
            )
        } else {
            (
                w.experts(&p("ffn_gate_exps.weight"), ne, nf, e)?,
                w.experts(&p("ffn_up_exps.weight"), ne, nf, e)?,
            )
        };
        let down = w.experts(&p("ffn_down_exps.weight"), ne, e, nf)?;
        let shared = if w.has(&p("ffn_up_shexp.weight")) {
            let gate_inp = w.linear(&p("ffn_gate_inp_shexp.weight"), 1, e)?;
            let s = cfg.n_ff_shexp;
            let ffn = DenseFfn {
                gate: w.linear(&p("ffn_gate_shexp.weight"), s, e)?,
                up: w.linear(&p("ffn_up_shexp.weight"), s, e)?,
                down: w.linear(&p("ffn_down_shexp.weight"), e, s)?,
            };
            Some((gate_inp, ffn))
        } else {
            None
        };
        Ok(MoeFfn {
            router: w.linear(&p("ffn_gate_inp.weight"), ne, e)?,
            gate,
            up,
            down,
            n_used: cfg.n_expert_used,
            shared,
            usage: ExpertUsage::new(ne),
        })
    }

    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let routing = self.route(x, n, pool)?;
        self.forward_routed(x, n, &routing, out, pool)
    }

    /// The router's choice for each of the `n` rows of `x`: softmax over all experts, the top
    /// `n_used` (ties to the lower id), weights renormalised over them.
    pub fn route(&self, x: &[f32], n: usize, pool: &ThreadPool) -> Result<Routing, ModelError> {
        let n_expert = self.router.rows;
        let k = self.n_used;
        let mut probs = vec![0.0f32; n * n_expert];
        self.router.forward(x, n, &mut probs, pool)?;
        let mut chosen = vec![(0usize, 0.0f32); n * k];
        let mut order: Vec<usize> = Vec::with_capacity(n_expert);
        for i in 0..n {
            let p = &mut probs[i * n_expert..(i + 1) * n_expert];
            ops::softmax(p);
            order.clear();
            order.extend(0..n_expert);
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let sum: f32 = order[..k].iter().map(|&e| p[e]).sum();
            let denom = sum.max(F16_MIN_NORMAL);
            for (slot, &e) in order[..k].iter().enumerate() {
                chosen[i * k + slot] = (e, p[e] / denom);
            }
        }
        Ok(Routing { k, chosen })
    }

    /// The routed experts (as `routing` chose them) and the shared expert for the `n` rows of
    /// `x`. Rows that picked the same expert share one pass over its weights.
    pub fn forward_routed(
        &self,
        x: &[f32],
        n: usize,
        routing: &Routing,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        self.forward_experts(x, n, routing, out, pool)?;
        let n_embd = self.router.cols;
        if let Some((gate_inp, ffn)) = &self.shared {
            let mut s = vec![0.0f32; n];
            gate_inp.forward(x, n, &mut s, pool)?;
            let mut shared = vec![0.0f32; n * n_embd];
            ffn.forward(x, n, &mut shared, pool)?;
            for i in 0..n {
                let gate = ops::sigmoid(s[i]);
                let o = &mut out[i * n_embd..(i + 1) * n_embd];
                o.iter_mut()
                    .zip(&shared[i * n_embd..(i + 1) * n_embd])
                    .for_each(|(a, &b)| *a += gate * b);
            }
        }
        Ok(())
    }

    /// The routed experts alone (as `routing` chose them) for the `n` rows of `x`: each row's
    /// experts weighted and summed in selection order into `out`. A model whose layer runs on a
    /// device with its experts in host memory computes this part here.
    pub fn forward_experts(
        &self,
        x: &[f32],
        n: usize,
        routing: &Routing,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let n_embd = self.router.cols;
        let k = routing.k;
        let n_expert = self.gate.len();
        let bad = ModelError::Routing {
            rows: n,
            per_row: k,
            found: routing.chosen.len(),
            n_expert,
        };
        if routing.chosen.len() != n * k || routing.chosen.iter().any(|&(e, _)| e >= n_expert) {
            return Err(bad);
        }
        let mut rows_of: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n_expert];
        for (at, &(e, _)) in routing.chosen.iter().enumerate() {
            rows_of[e].push((at / k, at % k));
        }
        let n_ff = self.gate.first().map(|l| l.rows).unwrap_or(0);
        let mut expert_out = vec![0.0f32; n * k * n_embd];
        let mut xin = Vec::new();
        let (mut g, mut u, mut d) = (Vec::new(), Vec::new(), Vec::new());
        for (e, rows) in rows_of.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let m = rows.len();
            self.usage.record(e);
            xin.clear();
            for &(i, _) in rows {
                xin.extend_from_slice(&x[i * n_embd..(i + 1) * n_embd]);
            }
            g.resize(m * n_ff, 0.0);
            u.resize(m * n_ff, 0.0);
            d.resize(m * n_embd, 0.0);
            self.gate[e].forward(&xin, m, &mut g, pool)?;
            self.up[e].forward(&xin, m, &mut u, pool)?;
            g.iter_mut()
                .zip(&u)
                .for_each(|(a, &b)| *a = ops::silu(*a) * b);
            self.down[e].forward(&g, m, &mut d, pool)?;
            for (j, &(i, slot)) in rows.iter().enumerate() {
                let w = routing.chosen[i * k + slot].1;
                let dst = &mut expert_out[(i * k + slot) * n_embd..][..n_embd];
                dst.iter_mut()
                    .zip(&d[j * n_embd..(j + 1) * n_embd])
                    .for_each(|(o, &v)| *o = w * v);
            }
        }
        // Sum the weighted experts in selection order, as ggml does.
        for i in 0..n {
            let o = &mut out[i * n_embd..(i + 1) * n_embd];
            o.copy_from_slice(&expert_out[i * k * n_embd..][..n_embd]);
            for slot in 1..k {
                ops::add_in_place(o, &expert_out[(i * k + slot) * n_embd..][..n_embd]);
            }
        }
        Ok(())
    }
}

/// Which experts each row of a MoE layer uses and with what weight: `chosen[i·k + slot]` is
/// `(expert, weight)` for row i's slot-th choice.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    k: usize,
    chosen: Vec<(usize, f32)>,
}

impl Routing {
    /// A routing of `rows.len()` rows, each a list of `k` experts with equal weights (the
    /// benchmarks use it to set how many experts consecutive rows share).
    pub fn uniform(rows: &[Vec<usize>]) -> Routing {
        let k = rows.first().map_or(0, Vec::len);
        let chosen = rows
            .iter()
            .flat_map(|r| r.iter().map(move |&e| (e, 1.0 / r.len() as f32)))
            .collect();
        Routing { k, chosen }
    }

    /// The routing a device's router made: for each row `k` expert ids and their weights,
    /// `ids[i·k + slot]`, `weights[i·k + slot]`. An id past `n_expert` or a length that is not
    /// `rows · k` is [`ModelError::Routing`].
    pub fn from_ids(
        k: usize,
        ids: &[u32],
        weights: &[f32],
        rows: usize,
        n_expert: usize,
    ) -> Result<Routing, ModelError> {
        if ids.len() != rows * k
            || weights.len() != ids.len()
            || ids.iter().any(|&e| e as usize >= n_expert)
        {
            return Err(ModelError::Routing {
                rows,
                per_row: k,
                found: ids.len(),
                n_expert,
            });
        }
        Ok(Routing {
            k,
            chosen: ids
                .iter()
                .map(|&e| e as usize)
                .zip(weights.iter().copied())
                .collect(),
        })
    }

    /// Experts per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Distinct experts over all rows.
    pub fn distinct(&self) -> usize {
        let mut e: Vec<usize> = self.chosen.iter().map(|&(e, _)| e).collect();
        e.sort_unstable();
        e.dedup();
        e.len()
    }
}

// One per layer, so the size difference between the variants costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Ffn {
    Dense(DenseFfn),
    Moe(MoeFfn),
}

impl Ffn {
    pub fn load(w: &WeightLoader, il: usize, cfg: &Qwen35Config) -> Result<Self, ModelError> {
        match cfg.arch {
            Arch::Dense => Ok(Ffn::Dense(DenseFfn::load(
                w,
                &format!("blk.{il}.ffn"),
                cfg.n_embd,
                cfg.n_ff[il],
            )?)),
            Arch::Moe => Ok(Ffn::Moe(MoeFfn::load(w, il, cfg)?)),
        }
    }

    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        match self {
            Ffn::Dense(f) => f.forward(x, n, out, pool),
            Ffn::Moe(f) => f.forward(x, n, out, pool),
        }
    }
}
