//! The bytes of memory one forward pass streams: every weight it reads once (routed experts only
//! when chosen), the embedding rows it looks up, the KV cache at the current context and the
//! delta-net states it reads and writes. Divided by a machine's streaming bandwidth this is the
//! pass's time floor, which makes timings comparable across machines.
//!
//! Activations, logits and per-row scratch are not counted: for the row counts of decode and
//! verify they are a fraction of a percent of the weights.

use crate::attention::GatedAttention;
use crate::cache::KvType;
use crate::delta_net::GatedDeltaNet;
use crate::ffn::{DenseFfn, Ffn, MoeFfn};
use crate::model::{DecoderLayer, Mixer, Model};
use crate::nextn::NextnHead;
use crate::weights::Linear;

/// Bytes one pass streams, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassBytes {
    /// Matrices and vectors read once per pass: projections, dense FFNs, routers, shared
    /// experts, norms, conv kernels.
    pub weights: u64,
    /// Routed expert matrices of the experts the pass chose (each read once per pass).
    pub experts: u64,
    /// The LM head, when the pass computes any logits.
    pub lm_head: u64,
    /// Embedding rows looked up.
    pub embedding: u64,
    /// Attention keys and values read at the current context plus the new rows written.
    pub kv_cache: u64,
    /// Delta-net recurrent and conv states, read and written.
    pub recurrent_state: u64,
}

impl PassBytes {
    pub fn total(&self) -> u64 {
        self.weights
            + self.experts
            + self.lm_head
            + self.embedding
            + self.kv_cache
            + self.recurrent_state
    }

    fn add(&mut self, o: &PassBytes) {
        self.weights += o.weights;
        self.experts += o.experts;
        self.lm_head += o.lm_head;
        self.embedding += o.embedding;
        self.kv_cache += o.kv_cache;
        self.recurrent_state += o.recurrent_state;
    }
}

/// What a pass does: `n_rows` new positions after `n_past` cached ones, logits for
/// `logit_rows` of them, with this KV cache element type.
#[derive(Clone, Copy, Debug)]
pub struct PassShape {
    pub n_past: usize,
    pub n_rows: usize,
    pub logit_rows: usize,
    pub k_type: KvType,
    pub v_type: KvType,
}

/// Bytes of a weight matrix as stored (quantized).
pub fn linear_bytes(l: &Linear) -> u64 {
    (l.rows * l.row_bytes()) as u64
}

fn vec_bytes(v: &[f32]) -> u64 {
    std::mem::size_of_val(v) as u64
}

fn dense_ffn_bytes(f: &DenseFfn) -> u64 {
    linear_bytes(&f.gate) + linear_bytes(&f.up) + linear_bytes(&f.down)
}

/// Bytes of one expert's three matrices.
pub fn expert_bytes(f: &MoeFfn, expert: usize) -> u64 {
    [&f.gate, &f.up, &f.down]
        .iter()
        .filter_map(|m| m.get(expert))
        .map(linear_bytes)
        .sum()
}

fn moe_bytes(f: &MoeFfn) -> PassBytes {
    let mut weights = linear_bytes(&f.router);
    if let Some((gate_inp, shared)) = &f.shared {
        weights += linear_bytes(gate_inp) + dense_ffn_bytes(shared);
    }
    PassBytes {
        weights,
        experts: f.usage.touched().iter().map(|&e| expert_bytes(f, e)).sum(),
        ..Default::default()
    }
}

fn attention_bytes(a: &GatedAttention, shape: &PassShape) -> PassBytes {
    let weights = [&a.wq, &a.wk, &a.wv, &a.wo]
        .into_iter()
        .map(linear_bytes)
        .sum::<u64>()
        + vec_bytes(&a.q_norm)
        + vec_bytes(&a.k_norm);
    let kv_width = a.n_head_kv * a.head_dim;
    let per_pos = (shape.k_type.row_bytes(kv_width) + shape.v_type.row_bytes(kv_width)) as u64;
    // Every cached position is read once, the new rows are written and read back.
    let positions = (shape.n_past + 2 * shape.n_rows) as u64;
    PassBytes {
        weights,
        kv_cache: per_pos * positions,
        ..Default::default()
    }
}

fn delta_net_bytes(d: &GatedDeltaNet) -> PassBytes {
    let weights = [&d.w_qkv, &d.w_gate, &d.w_beta, &d.w_alpha, &d.w_out]
        .into_iter()
        .map(linear_bytes)
        .sum::<u64>()
        + vec_bytes(&d.conv)
        + vec_bytes(&d.dt_bias)
        + vec_bytes(&d.a)
        + vec_bytes(&d.norm);
    let cache = d.new_cache();
    let state = vec_bytes(&cache.state.ssm) + vec_bytes(&cache.state.conv);
    PassBytes {
        weights,
        recurrent_state: 2 * state,
        ..Default::default()
    }
}

/// One decoder layer's share of a pass; routed experts as recorded by the layer's
/// [`crate::ffn::ExpertUsage`] since its last reset.
pub fn layer_bytes(layer: &DecoderLayer, shape: &PassShape) -> PassBytes {
    let mut b = match &layer.mixer {
        Mixer::Attention(a) => attention_bytes(a, shape),
        Mixer::DeltaNet(d) => delta_net_bytes(d),
    };
    b.weights += vec_bytes(&layer.attn_norm) + vec_bytes(&layer.post_attention_norm);
    match &layer.ffn {
        Ffn::Dense(f) => b.weights += dense_ffn_bytes(f),
        Ffn::Moe(f) => b.add(&moe_bytes(f)),
    }
    b
}

/// Bytes of one trunk pass ([`Model::forward`] / [`Model::forward_verify`]). For a MoE model,
/// call [`reset_expert_usage`] before the pass: the experts counted are those read since then.
pub fn trunk_pass_bytes(model: &Model, shape: &PassShape) -> PassBytes {
    let mut b = PassBytes::default();
    for layer in &model.layers {
        b.add(&layer_bytes(layer, shape));
    }
    b.weights += vec_bytes(&model.output_norm);
    b.embedding = (shape.n_rows * model.token_embd.row_bytes()) as u64;
    if shape.logit_rows > 0 {
        b.lm_head = linear_bytes(&model.lm_head);
    }
    b
}

/// Bytes of one NextN head pass ([`NextnHead::forward`]); `shape.n_past` is the head's own cache
/// length. Experts as for [`trunk_pass_bytes`] (reset with [`reset_head_expert_usage`]).
pub fn head_pass_bytes(head: &NextnHead, shape: &PassShape) -> PassBytes {
    let mut b = layer_bytes(&head.layer, shape);
    b.weights += linear_bytes(&head.eh_proj)
        + vec_bytes(&head.enorm)
        + vec_bytes(&head.hnorm)
        + vec_bytes(&head.shared_head_norm);
    b.embedding = (shape.n_rows * head.embed.row_bytes()) as u64;
    if shape.logit_rows > 0 {
        b.lm_head = linear_bytes(&head.lm_head);
    }
    b
}

fn reset_layer(layer: &DecoderLayer) {
    if let Ffn::Moe(f) = &layer.ffn {
        f.usage.reset();
    }
}

/// Forget the experts recorded by every MoE layer of the trunk.
pub fn reset_expert_usage(model: &Model) {
    model.layers.iter().for_each(reset_layer);
}

pub fn reset_head_expert_usage(head: &NextnHead) {
    reset_layer(&head.layer);
}

/// Distinct experts read and expert weight passes since the last reset, summed over layers.
/// The two are equal when every pass read each chosen expert once, however many rows chose it.
pub fn expert_reads(layers: &[DecoderLayer]) -> (u64, u64) {
    let mut distinct = 0;
    let mut reads = 0;
    for layer in layers {
        if let Ffn::Moe(f) = &layer.ffn {
            distinct += f.usage.touched().len() as u64;
            reads += f.usage.weight_reads();
        }
    }
    (distinct, reads)
}

/// Bytes of every routed expert of the trunk: what a pass would stream if it read all of them.
pub fn all_expert_bytes(model: &Model) -> u64 {
    model
        .layers
        .iter()
        .filter_map(|l| match &l.ffn {
            Ffn::Moe(f) => Some((0..f.gate.len()).map(|e| expert_bytes(f, e)).sum::<u64>()),
            Ffn::Dense(_) => None,
        })
        .sum()
}
