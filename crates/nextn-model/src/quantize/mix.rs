//! Which ggml type each tensor gets in a quantized file: llama-quantize's rules
//! (`src/llama-quant.cpp`: `tensor_allows_quantization`, `llama_tensor_get_type`,
//! `llama_tensor_get_type_impl`, `tensor_type_fallback`) for the file types nextn writes, with its
//! overrides (`--tensor-type`, `--output-tensor-type`, `--token-embedding-type`, `--pure`,
//! `--leave-output-tensor`). The counters that make a rule depend on a tensor's place
//! (`use_more_bits` over the attention-V tensors and the FFN-down layers) run in the order
//! llama-quantize visits tensors ([`llama_order`]).

use nextn_gguf::GgmlType;
use regex::Regex;

use crate::config::block_of;

/// The file types `nextn quantize` and `nextn synth` write, named and numbered as llama.cpp does
/// (`llama_ftype` in llama.h; the number is `general.file_type`).
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
    Q2_K,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
}

impl FileType {
    pub const ALL: [FileType; 19] = [
        FileType::F32,
        FileType::F16,
        FileType::BF16,
        FileType::Q8_0,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q2_K,
        FileType::Q3_K_S,
        FileType::Q3_K_M,
        FileType::Q3_K_L,
        FileType::Q4_K_S,
        FileType::Q4_K_M,
        FileType::Q5_K_S,
        FileType::Q5_K_M,
        FileType::Q6_K,
        FileType::IQ4_NL,
        FileType::IQ4_XS,
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
            FileType::Q2_K => "Q2_K",
            FileType::Q3_K_S => "Q3_K_S",
            FileType::Q3_K_M => "Q3_K_M",
            FileType::Q3_K_L => "Q3_K_L",
            FileType::Q4_K_S => "Q4_K_S",
            FileType::Q4_K_M => "Q4_K_M",
            FileType::Q5_K_S => "Q5_K_S",
            FileType::Q5_K_M => "Q5_K_M",
            FileType::Q6_K => "Q6_K",
            FileType::IQ4_NL => "IQ4_NL",
            FileType::IQ4_XS => "IQ4_XS",
        }
    }

    /// Case-insensitive, as llama-quantize spells the types; its aliases `Q4_K` and `Q5_K`
    /// (the `_M` mixes) and `Q3_K` (`Q3_K_M`) too.
    pub fn parse(s: &str) -> Option<FileType> {
        let upper = s.to_ascii_uppercase();
        let name = match upper.as_str() {
            "Q4_K" => "Q4_K_M",
            "Q5_K" => "Q5_K_M",
            "Q3_K" => "Q3_K_M",
            other => other,
        };
        FileType::ALL.into_iter().find(|t| t.name() == name)
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
            FileType::Q2_K => 10,
            FileType::Q3_K_S => 11,
            FileType::Q3_K_M => 12,
            FileType::Q3_K_L => 13,
            FileType::Q4_K_S => 14,
            FileType::Q4_K_M => 15,
            FileType::Q5_K_S => 16,
            FileType::Q5_K_M => 17,
            FileType::Q6_K => 18,
            FileType::IQ4_NL => 25,
            FileType::IQ4_XS => 30,
            FileType::BF16 => 32,
        }
    }

    /// The type of most 2-D weights (llama.cpp's `llama_ftype_get_default_type`).
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
            FileType::Q2_K => GgmlType::Q2_K,
            FileType::Q3_K_S | FileType::Q3_K_M | FileType::Q3_K_L => GgmlType::Q3_K,
            FileType::Q4_K_S | FileType::Q4_K_M => GgmlType::Q4_K,
            FileType::Q5_K_S | FileType::Q5_K_M => GgmlType::Q5_K,
            FileType::Q6_K => GgmlType::Q6_K,
            FileType::IQ4_NL => GgmlType::IQ4_NL,
            FileType::IQ4_XS => GgmlType::IQ4_XS,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.base_type().is_quantized()
    }
}

/// What the rules need to know about the model (llama.cpp's hparams).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelFacts {
    /// `block_count`: trunk and NextN layers.
    pub n_layer_all: usize,
    pub n_expert: usize,
    /// Query heads per KV head of the first layer (llama.cpp's `n_gqa()`).
    pub n_gqa: usize,
}

/// The user's choices on top of the file type.
#[derive(Clone, Debug, Default)]
pub struct MixOptions {
    /// `--tensor-type PATTERN=TYPE`, in order; the first pattern found in a name wins.
    pub overrides: Vec<(Regex, GgmlType)>,
    /// `--output-tensor-type`.
    pub output_type: Option<GgmlType>,
    /// `--token-embedding-type`.
    pub token_embedding_type: Option<GgmlType>,
    /// `--pure`: the base type for every quantizable tensor (no mix).
    pub pure: bool,
    /// `--leave-output-tensor`: keep `output.weight` in its source type.
    pub leave_output: bool,
    /// An importance matrix is used (some rules change with it).
    pub has_imatrix: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    /// `attn_v`, and the delta-net `attn_qkv` (llama.cpp's `category_is_attn_v`).
    AttentionV,
    AttentionK,
    AttentionQ,
    AttentionOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        Category::Output
    } else if name == "token_embd.weight" {
        Category::TokenEmbd
    } else if name.contains("attn_qkv.weight")
        || name.contains("attn_kv_b.weight")
        || name.contains("attn_v.weight")
    {
        Category::AttentionV
    } else if name.contains("attn_k.weight") {
        Category::AttentionK
    } else if name.contains("attn_q.weight") {
        Category::AttentionQ
    } else if name.contains("attn_output.weight") {
        Category::AttentionOutput
    } else if name.contains("ffn_up") {
        Category::FfnUp
    } else if name.contains("ffn_gate") {
        Category::FfnGate
    } else if name.contains("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// Whether llama-quantize quantizes a tensor at all (`tensor_allows_quantization`, the rules
/// that concern qwen35/qwen35moe names): 2-D and 3-D `*weight` tensors except norms, the
/// expert router and the delta-net conv kernel.
pub fn allows_quantization(name: &str, dims: &[u64], leave_output: bool) -> bool {
    let n_dims = dims.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
    n_dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && (!leave_output || name != "output.weight")
        && !name.contains("ffn_gate_inp.weight")
        && !name.contains("ssm_conv1d")
}

/// llama-quantize's first-and-last-eighth-and-every-third rule.
fn use_more_bits(i_layer: usize, n_layers: usize) -> bool {
    i_layer < n_layers / 8
        || i_layer >= 7 * n_layers / 8
        || (i_layer as i64 - (n_layers / 8) as i64).rem_euclid(3) == 2
}

/// A type that divides the row, as `tensor_type_fallback` picks it (F16 when nothing does).
pub fn fallback(ty: GgmlType, ne0: u64) -> GgmlType {
    let fits = |t: GgmlType| ne0.is_multiple_of(t.block_size() as u64);
    if fits(ty) {
        return ty;
    }
    let alt = match ty {
        GgmlType::IQ4_XS => GgmlType::IQ4_NL,
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other => other,
    };
    if fits(alt) {
        alt
    } else {
        GgmlType::F16
    }
}

/// The order llama-quantize visits (and writes) tensors: its loader's map orders names by layer
/// (tensors outside `blk.N` first), then by name.
pub fn llama_order(names: &mut [String]) {
    names.sort_by(|a, b| {
        let key = |n: &str| block_of(n).map_or(-1, |l| l as i64);
        key(a).cmp(&key(b)).then_with(|| a.cmp(b))
    });
}

/// The type of every tensor, `tensors` being `(name, ne dims, source type)` in
/// [`llama_order`].
pub fn choose_types(
    tensors: &[(String, Vec<u64>, GgmlType)],
    ftype: FileType,
    facts: ModelFacts,
    opts: &MixOptions,
) -> Vec<GgmlType> {
    let base = ftype.base_type();
    let tied = !tensors.iter().any(|(n, _, _)| n == "output.weight");
    let n_attention_wv = tensors
        .iter()
        .filter(|(n, _, _)| category(n) == Category::AttentionV)
        .count();
    let mut state = Counters::default();
    tensors
        .iter()
        .map(|(name, dims, source)| {
            if !allows_quantization(name, dims, opts.leave_output) {
                return *source;
            }
            let cat = category(name);
            if let (Some(t), Category::TokenEmbd) = (opts.token_embedding_type, cat) {
                return t;
            }
            if let (Some(t), Category::Output) = (opts.output_type, cat) {
                return t;
            }
            if !base.is_quantized() {
                return base;
            }
            let manual = opts
                .overrides
                .iter()
                .find(|(pattern, _)| pattern.is_match(name))
                .map(|&(_, t)| t);
            let ty = match manual {
                Some(t) => t,
                None if opts.pure => base,
                None => mix_type(
                    &mut state,
                    Rule {
                        ftype,
                        facts,
                        tied,
                        n_attention_wv,
                        has_imatrix: opts.has_imatrix,
                        output_type: opts.output_type,
                        token_embedding_type: opts.token_embedding_type,
                    },
                    base,
                    name,
                    dims[0],
                    cat,
                ),
            };
            fallback(ty, dims[0])
        })
        .collect()
}

#[derive(Default)]
struct Counters {
    i_attention_wv: usize,
    i_ffn_down: usize,
}

#[derive(Clone, Copy)]
struct Rule {
    ftype: FileType,
    facts: ModelFacts,
    tied: bool,
    n_attention_wv: usize,
    has_imatrix: bool,
    output_type: Option<GgmlType>,
    token_embedding_type: Option<GgmlType>,
}

/// `llama_tensor_get_type_impl` for the file types of [`FileType`].
fn mix_type(
    state: &mut Counters,
    r: Rule,
    base: GgmlType,
    name: &str,
    ne0: u64,
    cat: Category,
) -> GgmlType {
    use FileType as F;
    use GgmlType as T;
    let ftype = r.ftype;
    let eight_experts = r.facts.n_expert == 8;
    let mut ty = base;
    match cat {
        Category::Output | Category::TokenEmbd if cat == Category::Output || r.tied => {
            if let Some(t) = r.output_type {
                ty = t;
            } else if !ne0.is_multiple_of(base.block_size() as u64) {
                ty = T::Q8_0;
            } else if base != T::Q8_0 {
                ty = T::Q6_K;
            }
        }
        Category::TokenEmbd => {
            if let Some(t) = r.token_embedding_type {
                ty = t;
            }
        }
        Category::AttentionV => {
            let (i, n) = (state.i_attention_wv, r.n_attention_wv);
            match ftype {
                F::Q2_K => ty = if r.facts.n_gqa >= 4 { T::Q4_K } else { T::Q3_K },
                F::Q3_K_M => ty = if i < 2 { T::Q5_K } else { T::Q4_K },
                F::Q3_K_L => ty = T::Q5_K,
                F::IQ4_NL | F::IQ4_XS if r.facts.n_gqa >= 4 => ty = T::Q5_K,
                F::Q4_K_M | F::Q5_K_M if use_more_bits(i, n) => ty = T::Q6_K,
                F::Q4_K_S if i < 4 => ty = T::Q5_K,
                _ => {}
            }
            if eight_experts {
                ty = T::Q8_0;
            }
            state.i_attention_wv += 1;
        }
        Category::AttentionK => {
            if eight_experts {
                ty = T::Q8_0;
            }
        }
        Category::FfnDown => {
            // With experts the layer comes from the name; otherwise the tensor's rank among
            // the FFN-down tensors is taken for its layer.
            let i_layer = if r.facts.n_expert > 1 {
                block_of(name).unwrap_or(0)
            } else {
                state.i_ffn_down
            };
            let n = r.facts.n_layer_all;
            match ftype {
                F::Q2_K => ty = T::Q3_K,
                F::Q3_K_M => ty = if i_layer < n / 16 { T::Q5_K } else { T::Q4_K },
                F::Q3_K_L => ty = T::Q5_K,
                F::Q4_K_M if use_more_bits(i_layer, n) => ty = T::Q6_K,
                // Q4_K_M ends the chain whether or not the layer gets more bits.
                F::Q4_K_M => {}
                F::IQ4_NL | F::IQ4_XS if i_layer < n / 8 && !r.has_imatrix => ty = T::Q5_K,
                F::Q5_K_M if use_more_bits(i_layer, n) => ty = T::Q6_K,
                F::Q4_K_S if i_layer < n / 8 => ty = T::Q5_K,
                F::Q4_0 | F::Q5_0 if r.has_imatrix && i_layer < n / 8 => {
                    ty = if ftype == F::Q4_0 { T::Q4_1 } else { T::Q5_1 };
                }
                _ => {}
            }
            state.i_ffn_down += 1;
        }
        Category::AttentionOutput => {
            if eight_experts {
                if matches!(
                    ftype,
                    F::Q2_K | F::Q3_K_S | F::Q3_K_M | F::IQ4_NL | F::Q4_K_S | F::Q4_K_M | F::IQ4_XS
                ) {
                    ty = T::Q5_K;
                }
            } else {
                match ftype {
                    F::Q2_K => ty = T::Q3_K,
                    F::Q3_K_M => ty = T::Q4_K,
                    F::Q3_K_L => ty = T::Q5_K,
                    _ => {}
                }
            }
        }
        Category::AttentionQ
        | Category::FfnUp
        | Category::FfnGate
        | Category::Output
        | Category::Other => {}
    }
    ty
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_type_names_round_trip() {
        for t in FileType::ALL {
            assert_eq!(FileType::parse(&t.name().to_lowercase()), Some(t));
        }
        assert_eq!(FileType::parse("q4_k"), Some(FileType::Q4_K_M));
        assert_eq!(FileType::parse("IQ2_XXS"), None);
    }

    #[test]
    fn llama_order_puts_global_tensors_first_and_layers_numerically() {
        let mut names: Vec<String> = [
            "blk.10.a",
            "token_embd.weight",
            "blk.2.b",
            "output.weight",
            "blk.2.a",
            "output_norm.weight",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        llama_order(&mut names);
        assert_eq!(
            names,
            [
                "output.weight",
                "output_norm.weight",
                "token_embd.weight",
                "blk.2.a",
                "blk.2.b",
                "blk.10.a"
            ]
        );
    }

    #[test]
    fn fallbacks_follow_llama_quantize() {
        assert_eq!(fallback(GgmlType::Q4_K, 128), GgmlType::Q5_0);
        assert_eq!(fallback(GgmlType::Q6_K, 128), GgmlType::Q8_0);
        assert_eq!(fallback(GgmlType::IQ4_XS, 96), GgmlType::IQ4_NL);
        assert_eq!(fallback(GgmlType::Q4_K, 100), GgmlType::F16);
        assert_eq!(fallback(GgmlType::Q8_0, 256), GgmlType::Q8_0);
    }
}
