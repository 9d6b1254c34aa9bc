//! Which tensors a synthesized file holds, in which order, with which ggml type and which random
//! initialisation: the full tensor inventory of docs/MODEL.md, "Tensor names", and
//! llama-quantize's per-tensor type mix.

use nextn_gguf::GgmlType;

use super::random::Init;
use super::spec::SynthSpec;
use crate::config::Arch;
pub use crate::quantize::mix::{self, FileType, MixOptions, ModelFacts};

/// One tensor of the file before types are chosen: name, `ne` dims, initialisation.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorShape {
    pub name: String,
    pub dims: Vec<u64>,
    pub init: Init,
}

/// One tensor as it will be written.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub init: Init,
}

impl PlannedTensor {
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Bytes of one `dims[0]` row; every planned type divides the row into whole blocks.
    pub fn row_bytes(&self) -> u64 {
        self.ty.row_bytes(self.dims[0]).unwrap_or(0)
    }

    pub fn n_bytes(&self) -> u64 {
        self.row_bytes() * self.n_rows()
    }
}

/// Scale of a weight with fan-in `cols` so that, given inputs of RMS 1, outputs have RMS `gain`.
fn fan_in(cols: usize, gain: f32) -> Init {
    Init::Normal {
        std: gain / (cols as f32).sqrt(),
    }
}

const NORM: Init = Init::AroundOne {
    center: 1.0,
    spread: 0.1,
};

fn layer_tensors(s: &SynthSpec, il: usize, out: &mut Vec<TensorShape>) {
    let e = s.n_embd;
    let mut push = |name: &str, dims: &[usize], init: Init| {
        out.push(TensorShape {
            name: format!("blk.{il}.{name}"),
            dims: dims.iter().map(|&d| d as u64).collect(),
            init,
        });
    };
    push("attn_norm.weight", &[e], NORM);
    push("post_attention_norm.weight", &[e], NORM);
    if s.is_full_attention(il) {
        let (h, hkv, hd) = (s.n_head, s.n_head_kv, s.head_dim);
        push("attn_q.weight", &[e, 2 * h * hd], fan_in(e, 1.0));
        push("attn_k.weight", &[e, hkv * hd], fan_in(e, 1.0));
        push("attn_v.weight", &[e, hkv * hd], fan_in(e, 1.0));
        push("attn_q_norm.weight", &[hd], NORM);
        push("attn_k_norm.weight", &[hd], NORM);
        push("attn_output.weight", &[h * hd, e], fan_in(h * hd, 1.0));
    } else {
        let (hv, dk, vd, cd) = (s.ssm_v_heads, s.ssm_head_dim, s.value_dim(), s.conv_dim());
        push("attn_qkv.weight", &[e, cd], fan_in(e, 1.0));
        push("attn_gate.weight", &[e, vd], fan_in(e, 1.0));
        push("ssm_beta.weight", &[e, hv], fan_in(e, 1.0));
        push("ssm_alpha.weight", &[e, hv], fan_in(e, 1.0));
        // Kc taps of std 1/sqrt(Kc) keep the conv output at about the input's scale.
        push(
            "ssm_conv1d.weight",
            &[s.conv_kernel, cd],
            Init::Normal {
                std: 1.0 / (s.conv_kernel as f32).sqrt(),
            },
        );
        push("ssm_dt.bias", &[hv], Init::Normal { std: 1.0 });
        // A = −exp(A_log) with a mix of fast and slow decays.
        push("ssm_a", &[hv], Init::NegExpUniform { lo: -2.0, hi: 1.0 });
        push("ssm_norm.weight", &[dk], NORM);
        push("ssm_out.weight", &[vd, e], fan_in(vd, 1.0));
    }
    match s.arch {
        Arch::Dense => {
            let f = s.n_ff;
            push("ffn_gate.weight", &[e, f], fan_in(e, 1.0));
            push("ffn_up.weight", &[e, f], fan_in(e, 1.0));
            push("ffn_down.weight", &[f, e], fan_in(f, 1.0));
        }
        Arch::Moe => {
            let (ne, f, sh) = (s.n_expert, s.n_ff_exp, s.n_ff_shexp);
            // Router logits of std ~2: a clear but not one-hot preference among experts.
            push("ffn_gate_inp.weight", &[e, ne], fan_in(e, 2.0));
            push("ffn_gate_exps.weight", &[e, f, ne], fan_in(e, 1.0));
            push("ffn_up_exps.weight", &[e, f, ne], fan_in(e, 1.0));
            push("ffn_down_exps.weight", &[f, e, ne], fan_in(f, 1.0));
            if sh > 0 {
                push("ffn_gate_inp_shexp.weight", &[e], fan_in(e, 1.0));
                push("ffn_gate_shexp.weight", &[e, sh], fan_in(e, 1.0));
                push("ffn_up_shexp.weight", &[e, sh], fan_in(e, 1.0));
                push("ffn_down_shexp.weight", &[sh, e], fan_in(sh, 1.0));
            }
        }
    }
    if il >= s.n_layer {
        push("nextn.eh_proj.weight", &[2 * e, e], fan_in(2 * e, 1.0));
        push("nextn.enorm.weight", &[e], NORM);
        push("nextn.hnorm.weight", &[e], NORM);
        push("nextn.shared_head_norm.weight", &[e], NORM);
    }
}

/// Every tensor of the model, in the order llama-quantize writes them: the global tensors sorted
/// by name, then each block's tensors sorted by name.
pub fn tensor_shapes(s: &SynthSpec) -> Vec<TensorShape> {
    let (e, v) = (s.n_embd as u64, s.n_vocab as u64);
    // Logits of std ~3 from a unit-RMS hidden state: peaked enough to be far from uniform, wide
    // enough that sampling still has choices. With a tied head the embedding rows serve both ends.
    let head = Init::Normal {
        std: 3.0 / (s.n_embd as f32).sqrt(),
    };
    let mut global = vec![
        TensorShape {
            name: "output_norm.weight".into(),
            dims: vec![e],
            init: NORM,
        },
        TensorShape {
            name: "token_embd.weight".into(),
            dims: vec![e, v],
            init: if s.tied {
                head
            } else {
                Init::Normal { std: 1.0 }
            },
        },
    ];
    if !s.tied {
        global.push(TensorShape {
            name: "output.weight".into(),
            dims: vec![e, v],
            init: head,
        });
    }
    global.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = global;
    for il in 0..s.n_layer_all() {
        let start = out.len();
        layer_tensors(s, il, &mut out);
        out[start..].sort_by(|a, b| a.name.cmp(&b.name));
    }
    out
}

/// The type of every tensor, by llama-quantize's mix for `ftype` from F32 sources
/// ([`crate::quantize::mix`]). Tensors come in [`tensor_shapes`] order, llama-quantize's.
pub fn plan(s: &SynthSpec, ftype: FileType) -> Vec<PlannedTensor> {
    let shapes = tensor_shapes(s);
    let listed: Vec<(String, Vec<u64>, GgmlType)> = shapes
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), GgmlType::F32))
        .collect();
    let facts = ModelFacts {
        n_layer_all: s.n_layer_all(),
        n_expert: if s.arch == Arch::Moe { s.n_expert } else { 0 },
        n_gqa: s.n_head / s.n_head_kv.max(1),
    };
    let types = mix::choose_types(&listed, ftype, facts, &MixOptions::default());
    shapes
        .into_iter()
        .zip(types)
        .map(|(t, ty)| PlannedTensor {
            name: t.name,
            dims: t.dims,
            ty,
            init: t.init,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_type_names_round_trip() {
        for t in FileType::ALL {
            assert_eq!(FileType::parse(&t.name().to_lowercase()), Some(t));
        }
        assert_eq!(FileType::parse("IQ2_XXS"), None);
    }

    #[test]
    fn q4_k_m_mix_on_the_real_0_8b_shape() {
        let s = SynthSpec::preset("0.8b").unwrap();
        let p = plan(&s, FileType::Q4_K_M);
        let ty = |n: &str| {
            p.iter()
                .find(|t| t.name == n)
                .unwrap_or_else(|| panic!("{n}"))
                .ty
        };
        assert_eq!(
            ty("token_embd.weight"),
            GgmlType::Q6_K,
            "tied embedding is quantized like the head"
        );
        assert_eq!(ty("output_norm.weight"), GgmlType::F32);
        assert_eq!(ty("blk.0.attn_qkv.weight"), GgmlType::Q6_K, "first eighth");
        assert_eq!(ty("blk.4.attn_qkv.weight"), GgmlType::Q4_K);
        assert_eq!(
            ty("blk.5.attn_qkv.weight"),
            GgmlType::Q6_K,
            "(5 - 3) % 3 == 2"
        );
        assert_eq!(
            ty("blk.24.attn_v.weight"),
            GgmlType::Q6_K,
            "last eighth (MTP block)"
        );
        assert_eq!(ty("blk.4.ffn_down.weight"), GgmlType::Q4_K);
        assert_eq!(ty("blk.2.ffn_down.weight"), GgmlType::Q6_K);
        assert_eq!(ty("blk.4.ffn_gate.weight"), GgmlType::Q4_K);
        assert_eq!(ty("blk.0.ssm_conv1d.weight"), GgmlType::F32);
        assert_eq!(ty("blk.0.ssm_a"), GgmlType::F32);
        assert_eq!(ty("blk.0.ssm_dt.bias"), GgmlType::F32);
        assert_eq!(ty("blk.24.nextn.eh_proj.weight"), GgmlType::Q4_K);
        assert_eq!(ty("blk.24.nextn.enorm.weight"), GgmlType::F32);
    }

    #[test]
    fn order_is_global_then_blocks_by_number() {
        let s = SynthSpec::preset("tiny").unwrap();
        let names: Vec<String> = tensor_shapes(&s).into_iter().map(|t| t.name).collect();
        assert_eq!(names[0], "output_norm.weight");
        assert_eq!(names[1], "token_embd.weight");
        let layers: Vec<usize> = names
            .iter()
            .filter_map(|n| crate::config::block_of(n))
            .collect();
        assert!(layers.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*layers.last().unwrap(), 4, "the NextN block is blk.4");
    }

    #[test]
    fn float_files_keep_the_converter_f32_list() {
        let s = SynthSpec::preset("tiny-moe").unwrap();
        for t in plan(&s, FileType::F16) {
            let want_f32 = t.dims.len() == 1
                || t.name.contains("ssm_conv1d")
                || t.name.contains("ffn_gate_inp.weight");
            assert_eq!(t.ty == GgmlType::F32, want_f32, "{}", t.name);
        }
    }
}
