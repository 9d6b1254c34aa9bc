//! The tensor inventory a configuration implies (docs/MODEL.md, "Tensor names"): used to check a
//! file without reading any tensor data (`nextn verify`, `nextn inspect`).

use nextn_gguf::{GgmlType, GgufFile};
use nextn_quant::formats;

use crate::config::{Arch, LayerKind, Qwen35Config};

/// A tensor the model expects: GGUF name and `ne` dims.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpectedTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub required: bool,
}

fn t(name: String, dims: &[usize], required: bool) -> ExpectedTensor {
    ExpectedTensor {
        name,
        dims: dims.iter().map(|&d| d as u64).collect(),
        required,
    }
}

fn attention_block(cfg: &Qwen35Config, il: usize, out: &mut Vec<ExpectedTensor>) {
    let (e, hd) = (cfg.n_embd, cfg.head_dim);
    let (h, hkv) = (cfg.n_head[il], cfg.n_head_kv[il]);
    let p = |n: &str| format!("blk.{il}.{n}");
    out.push(t(p("attn_q.weight"), &[e, 2 * h * hd], true));
    out.push(t(p("attn_k.weight"), &[e, hkv * hd], true));
    out.push(t(p("attn_v.weight"), &[e, hkv * hd], true));
    out.push(t(p("attn_q_norm.weight"), &[hd], true));
    out.push(t(p("attn_k_norm.weight"), &[hd], true));
    out.push(t(p("attn_output.weight"), &[h * hd, e], true));
}

fn delta_net_block(cfg: &Qwen35Config, il: usize, out: &mut Vec<ExpectedTensor>) {
    let (e, hv, dk) = (cfg.n_embd, cfg.ssm_v_heads, cfg.ssm_head_dim);
    let p = |n: &str| format!("blk.{il}.{n}");
    out.push(t(p("attn_qkv.weight"), &[e, cfg.conv_dim()], true));
    out.push(t(p("attn_gate.weight"), &[e, cfg.ssm_inner], true));
    out.push(t(p("ssm_beta.weight"), &[e, hv], true));
    out.push(t(p("ssm_alpha.weight"), &[e, hv], true));
    out.push(t(
        p("ssm_conv1d.weight"),
        &[cfg.conv_kernel, cfg.conv_dim()],
        true,
    ));
    out.push(t(p("ssm_dt.bias"), &[hv], true));
    out.push(t(p("ssm_a"), &[hv], true));
    out.push(t(p("ssm_norm.weight"), &[dk], true));
    out.push(t(p("ssm_out.weight"), &[cfg.ssm_inner, e], true));
}

fn ffn_block(cfg: &Qwen35Config, il: usize, fused_gate_up: bool, out: &mut Vec<ExpectedTensor>) {
    let e = cfg.n_embd;
    let p = |n: &str| format!("blk.{il}.{n}");
    match cfg.arch {
        Arch::Dense => {
            let f = cfg.n_ff[il];
            out.push(t(p("ffn_gate.weight"), &[e, f], true));
            out.push(t(p("ffn_up.weight"), &[e, f], true));
            out.push(t(p("ffn_down.weight"), &[f, e], true));
        }
        Arch::Moe => {
            let (ne, f, s) = (cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp);
            out.push(t(p("ffn_gate_inp.weight"), &[e, ne], true));
            if fused_gate_up {
                out.push(t(p("ffn_gate_up_exps.weight"), &[e, 2 * f, ne], true));
            } else {
                out.push(t(p("ffn_gate_exps.weight"), &[e, f, ne], true));
                out.push(t(p("ffn_up_exps.weight"), &[e, f, ne], true));
            }
            out.push(t(p("ffn_down_exps.weight"), &[f, e, ne], true));
            out.push(t(p("ffn_gate_inp_shexp.weight"), &[e], false));
            out.push(t(p("ffn_gate_shexp.weight"), &[e, s], false));
            out.push(t(p("ffn_up_shexp.weight"), &[e, s], false));
            out.push(t(p("ffn_down_shexp.weight"), &[s, e], false));
        }
    }
}

fn decoder_layer(
    cfg: &Qwen35Config,
    f: &GgufFile,
    il: usize,
    kind: LayerKind,
    out: &mut Vec<ExpectedTensor>,
) {
    let e = cfg.n_embd;
    out.push(t(format!("blk.{il}.attn_norm.weight"), &[e], true));
    out.push(t(
        format!("blk.{il}.post_attention_norm.weight"),
        &[e],
        true,
    ));
    match kind {
        LayerKind::FullAttention => attention_block(cfg, il, out),
        LayerKind::DeltaNet => delta_net_block(cfg, il, out),
    }
    let fused = f
        .tensor(&format!("blk.{il}.ffn_gate_up_exps.weight"))
        .is_some();
    ffn_block(cfg, il, fused, out);
}

/// Trunk tensors: embedding, every decoder layer, final norm, optional untied head.
pub fn trunk_tensors(cfg: &Qwen35Config, f: &GgufFile, n_vocab: usize) -> Vec<ExpectedTensor> {
    let e = cfg.n_embd;
    let mut out = vec![t("token_embd.weight".into(), &[e, n_vocab], true)];
    for (il, &kind) in cfg.layer_kinds.iter().enumerate() {
        decoder_layer(cfg, f, il, kind, &mut out);
    }
    out.push(t("output_norm.weight".into(), &[e], true));
    out.push(t("output.weight".into(), &[e, n_vocab], false));
    out
}

/// The NextN block `blk.N` (docs/MODEL.md, "NextN block tensors"): a full-attention decoder layer
/// plus the nextn.* tensors.
pub fn nextn_tensors(cfg: &Qwen35Config, f: &GgufFile, n_vocab: usize) -> Vec<ExpectedTensor> {
    let Some(n) = cfg.nextn_block() else {
        return Vec::new();
    };
    let e = cfg.n_embd;
    let mut out = Vec::new();
    decoder_layer(cfg, f, n, LayerKind::FullAttention, &mut out);
    let p = |x: &str| format!("blk.{n}.nextn.{x}");
    out.push(t(p("eh_proj.weight"), &[2 * e, e], true));
    out.push(t(p("enorm.weight"), &[e], true));
    out.push(t(p("hnorm.weight"), &[e], true));
    out.push(t(p("shared_head_norm.weight"), &[e], false));
    out.push(t(p("embed_tokens.weight"), &[e, n_vocab], false));
    out.push(t(p("shared_head_head.weight"), &[e, n_vocab], false));
    out
}

/// Why a tensor does not fit what the model needs.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorProblem {
    Missing {
        name: String,
    },
    Shape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    Type {
        name: String,
        ty: GgmlType,
    },
}

impl std::fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorProblem::Missing { name } => write!(f, "tensor '{name}' is missing"),
            TensorProblem::Shape {
                name,
                expected,
                found,
            } => {
                write!(
                    f,
                    "tensor '{name}' has shape {found:?}, expected {expected:?}"
                )
            }
            TensorProblem::Type { name, ty } => {
                write!(f, "unsupported tensor type {ty} in tensor {name}")
            }
        }
    }
}

fn trim(d: &[u64]) -> Vec<u64> {
    let mut v = d.to_vec();
    while v.len() > 1 && v.last() == Some(&1) {
        v.pop();
    }
    v
}

/// Check each expected tensor against the file's directory (no tensor data is read).
pub fn check(f: &GgufFile, expected: &[ExpectedTensor]) -> Vec<TensorProblem> {
    let mut problems = Vec::new();
    for x in expected {
        match f.tensor(&x.name) {
            None if x.required => problems.push(TensorProblem::Missing {
                name: x.name.clone(),
            }),
            None => {}
            Some(info) => {
                if trim(&info.dims) != trim(&x.dims) {
                    problems.push(TensorProblem::Shape {
                        name: x.name.clone(),
                        expected: x.dims.clone(),
                        found: info.dims.clone(),
                    });
                } else if !formats::can_dequantize(info.ty) {
                    problems.push(TensorProblem::Type {
                        name: x.name.clone(),
                        ty: info.ty,
                    });
                }
            }
        }
    }
    problems
}

/// Vocabulary size implied by the embedding tensor (0 when absent).
pub fn n_vocab(f: &GgufFile) -> usize {
    f.tensor("token_embd.weight")
        .and_then(|t| t.dims.get(1).copied())
        .unwrap_or(0) as usize
}
