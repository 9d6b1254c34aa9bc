//! Which tensors a synthesized file holds, in which order, with which ggml type and which random
//! initialisation: the full tensor inventory of docs/MODEL.md, "Tensor names", and
//! llama-quantize's per-tensor type mix.

use nextn_gguf::GgmlType;

use super::random::Init;
use super::spec::SynthSpec;
use crate::config::Arch;

/// The file types `nextn synth --type` writes, named as llama-quantize names them.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4_K_M,
    Q5_K_M,
    Q6_K,
}

impl FileType {
    pub const ALL: [FileType; 11] = [
        FileType::F32,
        FileType::F16,
        FileType::BF16,
        FileType::Q8_0,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q4_K_M,
        FileType::Q5_K_M,
        FileType::Q6_K,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FileType::F32 => "F32",
            FileType::F16 => "F16",
            FileType::BF16 => "BF16",
            FileType::Q8_0 => "Q8_0",
            FileType::Q4_0 => "Q4_0",
            FileType::Q4_1 => "Q4_1",
            FileType::Q5_0 => "Q5_0",
            FileType::Q5_1 => "Q5_1",
            FileType::Q4_K_M => "Q4_K_M",
            FileType::Q5_K_M => "Q5_K_M",
            FileType::Q6_K => "Q6_K",
        }
    }

    /// Case-insensitive, as llama-quantize spells the types.
    pub fn parse(s: &str) -> Option<FileType> {
        FileType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
    }

    /// `general.file_type` (llama.h `llama_ftype`).
    pub fn llama_ftype(self) -> u32 {
        match self {
            FileType::F32 => 0,
            FileType::F16 => 1,
            FileType::Q4_0 => 2,
            FileType::Q4_1 => 3,
            FileType::Q8_0 => 7,
            FileType::Q5_0 => 8,
            FileType::Q5_1 => 9,
            FileType::Q4_K_M => 15,
            FileType::Q5_K_M => 17,
            FileType::Q6_K => 18,
            FileType::BF16 => 32,
        }
    }

    /// The type of most 2-D weights.
    pub fn base_type(self) -> GgmlType {
        match self {
            FileType::F32 => GgmlType::F32,
            FileType::F16 => GgmlType::F16,
            FileType::BF16 => GgmlType::BF16,
            FileType::Q8_0 => GgmlType::Q8_0,
            FileType::Q4_0 => GgmlType::Q4_0,
            FileType::Q4_1 => GgmlType::Q4_1,
            FileType::Q5_0 => GgmlType::Q5_0,
            FileType::Q5_1 => GgmlType::Q5_1,
            FileType::Q4_K_M => GgmlType::Q4_K,
            FileType::Q5_K_M => GgmlType::Q5_K,
            FileType::Q6_K => GgmlType::Q6_K,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.base_type().is_quantized()
    }
}

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

/// What llama-quantize keeps in its source type (F32 here): 1-D tensors, non-`weight` tensors,
/// norms, the router and the conv kernel (docs/MODEL.md, "Tensor types and scales"; llama.cpp's
/// `tensor_allows_quantization`).
fn stays_f32(name: &str, dims: &[u64]) -> bool {
    dims.len() < 2
        || !name.ends_with("weight")
        || name.contains("_norm.weight")
        || name.contains("ffn_gate_inp.weight")
        || name.contains("ssm_conv1d")
}

/// llama-quantize's choice among types that divide the row into whole blocks.
fn fallback(ty: GgmlType, ne0: u64) -> GgmlType {
    let fits = |t: GgmlType| ne0.is_multiple_of(t.block_size() as u64);
    if fits(ty) {
        return ty;
    }
    let alt = match ty {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        // llama-quantize aborts here (no fallback for Q8_0 / Q4_0 ...); F16 keeps the file usable.
        _ => GgmlType::F16,
    };
    if fits(alt) {
        alt
    } else {
        GgmlType::F16
    }
}

/// The `blk.N.` layer of a tensor name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// llama-quantize's layer rule for the K-quant mixes: first and last eighth, and every third layer
/// in between, get more bits.
fn use_more_bits(i_layer: usize, n_layers: usize) -> bool {
    i_layer < n_layers / 8
        || i_layer >= 7 * n_layers / 8
        || (i_layer as i64 - (n_layers / 8) as i64).rem_euclid(3) == 2
}

/// The type of every tensor, following llama-quantize's `llama_tensor_get_type` for the mixes we
/// write (no imatrix, no overrides). Tensors must come in [`tensor_shapes`] order: the attention-V
/// counter runs in file order, as in llama-quantize.
pub fn plan(s: &SynthSpec, ftype: FileType) -> Vec<PlannedTensor> {
    let shapes = tensor_shapes(s);
    let is_attn_v = |n: &str| n.contains("attn_v.weight") || n.contains("attn_qkv.weight");
    let n_attention_wv = shapes.iter().filter(|t| is_attn_v(&t.name)).count();
    let mut i_attention_wv = 0;
    let base = ftype.base_type();
    let k_mix = matches!(ftype, FileType::Q4_K_M | FileType::Q5_K_M);
    let n_layer_all = s.n_layer_all();
    let eight_experts = s.arch == Arch::Moe && s.n_expert == 8;
    shapes
        .into_iter()
        .map(|t| {
            let name = t.name.as_str();
            let ne0 = t.dims[0];
            let ty = if stays_f32(name, &t.dims) {
                GgmlType::F32
            } else if !ftype.is_quantized() {
                base
            } else {
                let mut ty = base;
                if name == "output.weight" || (s.tied && name == "token_embd.weight") {
                    if !ne0.is_multiple_of(base.block_size() as u64) {
                        ty = GgmlType::Q8_0;
                    } else if base != GgmlType::Q8_0 {
                        ty = GgmlType::Q6_K;
                    }
                } else if name == "token_embd.weight" {
                    // untied embedding: the base type
                } else if is_attn_v(name) {
                    if k_mix && use_more_bits(i_attention_wv, n_attention_wv) {
                        ty = GgmlType::Q6_K;
                    }
                    if eight_experts {
                        ty = GgmlType::Q8_0;
                    }
                    i_attention_wv += 1;
                } else if name.contains("attn_k.weight") {
                    if eight_experts {
                        ty = GgmlType::Q8_0;
                    }
                } else if name.contains("ffn_up") || name.contains("ffn_gate") {
                    // the base type for these mixes
                } else if name.contains("ffn_down") {
                    if k_mix && use_more_bits(layer_of(name).unwrap_or(0), n_layer_all) {
                        ty = GgmlType::Q6_K;
                    }
                } else if name.contains("attn_output.weight")
                    && eight_experts
                    && ftype == FileType::Q4_K_M
                {
                    ty = GgmlType::Q5_K;
                }
                fallback(ty, ne0)
            };
            PlannedTensor {
                name: t.name,
                dims: t.dims,
                ty,
                init: t.init,
            }
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
        assert_eq!(FileType::parse("Q3_K_S"), None);
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
    fn fallbacks_follow_llama_quantize() {
        assert_eq!(fallback(GgmlType::Q4_K, 128), GgmlType::Q5_0);
        assert_eq!(fallback(GgmlType::Q5_K, 96), GgmlType::Q5_1);
        assert_eq!(fallback(GgmlType::Q6_K, 160), GgmlType::Q8_0);
        assert_eq!(fallback(GgmlType::Q6_K, 100), GgmlType::F16);
        assert_eq!(fallback(GgmlType::Q8_0, 100), GgmlType::F16);
        assert_eq!(fallback(GgmlType::Q4_K, 512), GgmlType::Q4_K);
    }

    #[test]
    fn order_is_global_then_blocks_by_number() {
        let s = SynthSpec::preset("tiny").unwrap();
        let names: Vec<String> = tensor_shapes(&s).into_iter().map(|t| t.name).collect();
        assert_eq!(names[0], "output_norm.weight");
        assert_eq!(names[1], "token_embd.weight");
        let layers: Vec<usize> = names.iter().filter_map(|n| layer_of(n)).collect();
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
