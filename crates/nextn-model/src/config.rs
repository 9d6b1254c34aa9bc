//! Hyper-parameters read from GGUF metadata (docs/MODEL.md, "GGUF metadata"), with llama.cpp's
//! defaults and derived values.

use nextn_gguf::{GgufFile, MetadataValue};

use crate::ModelError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `qwen35`: dense SwiGLU FFN in every layer.
    Dense,
    /// `qwen35moe`: routed experts plus a sigmoid-gated shared expert.
    Moe,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Dense => "qwen35",
            Arch::Moe => "qwen35moe",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    FullAttention,
    DeltaNet,
}

/// RoPE frequency scaling. Only what text-only Qwen3.5 files use is accepted; YaRN is refused at load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { freq_scale: f32 },
}

#[derive(Clone, Debug)]
pub struct Qwen35Config {
    pub arch: Arch,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    /// `block_count`: trunk layers plus NextN layers.
    pub n_layer_all: usize,
    /// Trunk layers: `block_count − nextn_predict_layers`.
    pub n_layer: usize,
    pub n_nextn: usize,
    /// Per layer (all `block_count` layers): dense FFN width.
    pub n_ff: Vec<usize>,
    pub n_head: Vec<usize>,
    pub n_head_kv: Vec<usize>,
    /// Attention head dim (q/k and v; llama.cpp requires them equal).
    pub head_dim: usize,
    pub rms_eps: f32,
    pub n_rot: usize,
    pub rope_sections: [i32; 4],
    pub rope_freq_base: f32,
    pub rope_scaling: RopeScaling,
    pub conv_kernel: usize,
    /// dk = dv: gated delta net head dim (`ssm.state_size`).
    pub ssm_head_dim: usize,
    /// Hk: q/k heads of the delta net.
    pub ssm_k_heads: usize,
    /// Hv: v heads of the delta net.
    pub ssm_v_heads: usize,
    /// value_dim = Hv·dv.
    pub ssm_inner: usize,
    /// Kind of every trunk layer.
    pub layer_kinds: Vec<LayerKind>,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_ff_shexp: usize,
}

/// The smallest `context_length` accepted: room for a short prompt and a few generated tokens.
pub const MIN_CONTEXT: usize = 16;

/// Entries a vector sized by one metadata value may have: far beyond any real model (a few
/// hundred layers), far below what would exhaust memory.
pub const MAX_FILE_SIZED_ENTRIES: usize = 1 << 20;

/// `n` copies of `fill`, where `n` was read from the file's metadata `key`: every allocation
/// sized by a file value goes through here, so a hostile value is refused with an error naming
/// the key instead of aborting the process on a failed allocation.
pub fn file_sized_vec<T: Clone>(key: &str, n: usize, fill: T) -> Result<Vec<T>, ModelError> {
    let refuse = |why: String| ModelError::BadValue {
        key: key.to_string(),
        why,
    };
    if n > MAX_FILE_SIZED_ENTRIES {
        return Err(refuse(format!(
            "{n} is beyond any model (at most {MAX_FILE_SIZED_ENTRIES})"
        )));
    }
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|e| refuse(format!("{n} entries cannot be allocated: {e}")))?;
    v.resize(n, fill);
    Ok(v)
}

/// The `N` of a `blk.N.*` tensor name.
pub fn block_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Layers the file's tensors are named for: one more than the highest `N` of a `blk.N.*` tensor
/// (0 when there is none).
pub fn layers_in_tensors(f: &GgufFile) -> usize {
    f.tensors()
        .iter()
        .filter_map(|t| block_of(&t.name))
        .map(|n| n + 1)
        .max()
        .unwrap_or(0)
}

impl Qwen35Config {
    pub fn key_dim(&self) -> usize {
        self.ssm_k_heads * self.ssm_head_dim
    }

    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.ssm_inner
    }

    pub fn n_full_attention(&self) -> usize {
        self.layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::FullAttention)
            .count()
    }

    /// Index of the NextN block (`blk.N`), if the file declares one.
    pub fn nextn_block(&self) -> Option<usize> {
        (self.n_nextn > 0).then_some(self.n_layer)
    }

    /// The configuration of a model file, with `block_count` checked against the `blk.N` tensors
    /// the file holds before anything is sized by it.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelError> {
        Self::from_metadata_with(f, Some(layers_in_tensors(f)))
    }

    /// The configuration its metadata alone describes, for a file whose tensors are not written
    /// yet (planning a synthetic model). Sizes stay bounded by [`file_sized_vec`].
    pub fn from_metadata(f: &GgufFile) -> Result<Self, ModelError> {
        Self::from_metadata_with(f, None)
    }

    fn from_metadata_with(f: &GgufFile, held_layers: Option<usize>) -> Result<Self, ModelError> {
        let arch_name = f
            .get_str("general.architecture")?
            .ok_or(ModelError::MissingKey("general.architecture".into()))?;
        let arch = match arch_name {
            "qwen35" => Arch::Dense,
            "qwen35moe" => Arch::Moe,
            other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
        };
        let m = Metadata {
            f,
            arch: arch_name.to_string(),
        };
        let n_ctx_train = m.context_length()?;
        let n_embd = m.req_u32("embedding_length")?;
        let blocks = m.blocks(held_layers)?;
        let heads = m.attention_heads(n_embd, blocks.n_layer_all)?;
        let n_ff = m.per_layer("feed_forward_length", Some(0), blocks.n_layer_all)?;
        let rms_eps = m.rms_eps()?;
        let rope = m.rope(heads.head_dim)?;
        let ssm = m.delta_net()?;
        let layer_kinds = m.layer_kinds(blocks.n_layer)?;
        let experts = match arch {
            Arch::Dense => Experts::default(),
            Arch::Moe => m.experts(n_ff.first().copied().unwrap_or(0))?,
        };
        m.check_kv_heads(&heads)?;
        Ok(Qwen35Config {
            arch,
            n_ctx_train,
            n_embd,
            n_layer_all: blocks.n_layer_all,
            n_layer: blocks.n_layer,
            n_nextn: blocks.n_nextn,
            n_ff,
            n_head: heads.n_head,
            n_head_kv: heads.n_head_kv,
            head_dim: heads.head_dim,
            rms_eps,
            n_rot: rope.n_rot,
            rope_sections: rope.sections,
            rope_freq_base: rope.freq_base,
            rope_scaling: rope.scaling,
            conv_kernel: ssm.conv_kernel,
            ssm_head_dim: ssm.head_dim,
            ssm_k_heads: ssm.k_heads,
            ssm_v_heads: ssm.v_heads,
            ssm_inner: ssm.inner,
            layer_kinds,
            n_expert: experts.n_expert,
            n_expert_used: experts.n_expert_used,
            n_ff_exp: experts.n_ff_exp,
            n_ff_shexp: experts.n_ff_shexp,
        })
    }
}

/// A file's `{arch}.*` metadata keys, read section by section; every refusal names its key.
struct Metadata<'f> {
    f: &'f GgufFile,
    arch: String,
}

/// `block_count` and how it divides into trunk and NextN layers.
struct Blocks {
    n_layer_all: usize,
    n_layer: usize,
    n_nextn: usize,
}

/// Attention heads per layer and their dimension.
struct AttentionHeads {
    n_head: Vec<usize>,
    n_head_kv: Vec<usize>,
    head_dim: usize,
}

struct Rope {
    n_rot: usize,
    sections: [i32; 4],
    freq_base: f32,
    scaling: RopeScaling,
}

/// The gated delta net's dimensions (`ssm.*`).
struct DeltaNetDims {
    conv_kernel: usize,
    head_dim: usize,
    k_heads: usize,
    v_heads: usize,
    inner: usize,
}

/// Routed and shared experts (all 0 for a dense model).
#[derive(Default)]
struct Experts {
    n_expert: usize,
    n_expert_used: usize,
    n_ff_exp: usize,
    n_ff_shexp: usize,
}

impl Metadata<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn bad(&self, k: &str, why: impl Into<String>) -> ModelError {
        ModelError::BadValue {
            key: self.key(k),
            why: why.into(),
        }
    }

    fn req_u32(&self, k: &str) -> Result<usize, ModelError> {
        let name = self.key(k);
        self.f
            .get_u32(&name)?
            .map(|v| v as usize)
            .ok_or(ModelError::MissingKey(name))
    }

    fn opt_u32(&self, k: &str) -> Result<Option<usize>, ModelError> {
        Ok(self.f.get_u32(&self.key(k))?.map(|v| v as usize))
    }

    /// A per-layer value of `n` layers: an array of one entry per layer, or one number for all
    /// (`default` for all when the key is absent and has one).
    fn per_layer(
        &self,
        k: &str,
        default: Option<usize>,
        n: usize,
    ) -> Result<Vec<usize>, ModelError> {
        let name = self.key(k);
        match self.f.get(&name) {
            None => match default {
                Some(d) => file_sized_vec(&name, n, d),
                None => Err(ModelError::MissingKey(name)),
            },
            Some(MetadataValue::Array(arr)) => {
                let vals = arr.as_u64_vec().ok_or_else(|| ModelError::BadValue {
                    key: name.clone(),
                    why: format!(
                        "expected an integer array, found {}",
                        arr.element_type_name()
                    ),
                })?;
                if vals.len() != n {
                    return Err(ModelError::BadValue {
                        key: name,
                        why: format!("array has {} entries, block_count is {n}", vals.len()),
                    });
                }
                Ok(vals.into_iter().map(|v| v as usize).collect())
            }
            Some(_) => {
                let v = self
                    .f
                    .get_u32(&name)?
                    .ok_or_else(|| ModelError::MissingKey(name.clone()))?;
                file_sized_vec(&name, n, v as usize)
            }
        }
    }

    fn context_length(&self) -> Result<usize, ModelError> {
        let n_ctx_train = self.req_u32("context_length")?;
        if n_ctx_train < MIN_CONTEXT {
            return Err(self.bad(
                "context_length",
                format!(
                    "{n_ctx_train} positions; a model needs at least {MIN_CONTEXT} to hold a prompt and its answer"
                ),
            ));
        }
        Ok(n_ctx_train)
    }

    /// `block_count`, checked against the `held` layers of the file's tensors (when known), and
    /// `nextn_predict_layers`.
    fn blocks(&self, held: Option<usize>) -> Result<Blocks, ModelError> {
        let n_layer_all = self.req_u32("block_count")?;
        // Everything per layer is sized by block_count, so it must match the layers the file
        // actually holds before anything is allocated from it.
        if let Some(held) = held.filter(|&held| held != n_layer_all) {
            return Err(self.bad(
                "block_count",
                format!(
                    "{n_layer_all}, but the file's tensors are for {held} layers (blk.0 .. blk.{})",
                    held.saturating_sub(1)
                ),
            ));
        }
        let n_nextn = self.opt_u32("nextn_predict_layers")?.unwrap_or(0);
        if n_layer_all == 0 || n_nextn >= n_layer_all {
            return Err(self.bad(
                "nextn_predict_layers",
                format!("{n_nextn} must be smaller than block_count {n_layer_all}"),
            ));
        }
        Ok(Blocks {
            n_layer_all,
            n_layer: n_layer_all - n_nextn,
            n_nextn,
        })
    }

    fn attention_heads(
        &self,
        n_embd: usize,
        n_layer_all: usize,
    ) -> Result<AttentionHeads, ModelError> {
        let n_head = self.per_layer("attention.head_count", None, n_layer_all)?;
        let n_head_kv = match self.f.get(&self.key("attention.head_count_kv")) {
            None => n_head.clone(),
            Some(_) => self.per_layer("attention.head_count_kv", None, n_layer_all)?,
        };
        let n_head0 = n_head.first().copied().unwrap_or(0);
        if n_head0 == 0 {
            return Err(self.bad("attention.head_count", "is 0"));
        }
        let head_dim = self
            .opt_u32("attention.key_length")?
            .unwrap_or(n_embd / n_head0);
        let v_dim = self
            .opt_u32("attention.value_length")?
            .unwrap_or(n_embd / n_head0);
        if head_dim != v_dim {
            return Err(self.bad(
                "attention.value_length",
                format!("{v_dim} differs from key_length {head_dim}"),
            ));
        }
        Ok(AttentionHeads {
            n_head,
            n_head_kv,
            head_dim,
        })
    }

    /// Every layer's heads a positive multiple of its kv heads.
    fn check_kv_heads(&self, heads: &AttentionHeads) -> Result<(), ModelError> {
        for (il, (&h, &hkv)) in heads.n_head.iter().zip(&heads.n_head_kv).enumerate() {
            if h == 0 || hkv == 0 || h % hkv != 0 {
                return Err(self.bad(
                    "attention.head_count_kv",
                    format!("layer {il}: {h} heads is not a multiple of {hkv} kv heads"),
                ));
            }
        }
        Ok(())
    }

    fn rms_eps(&self) -> Result<f32, ModelError> {
        let eps_key = "attention.layer_norm_rms_epsilon";
        let rms_eps = self
            .f
            .get_f32(&self.key(eps_key))?
            .ok_or(ModelError::MissingKey(self.key(eps_key)))?;
        if !(rms_eps.is_finite() && rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(self.bad(
                eps_key,
                format!("{rms_eps} must be a finite number between 0 and 1 (exclusive)"),
            ));
        }
        Ok(rms_eps)
    }

    fn rope(&self, head_dim: usize) -> Result<Rope, ModelError> {
        let n_rot = self.opt_u32("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
            return Err(self.bad(
                "rope.dimension_count",
                format!("{n_rot} must be even, positive and at most the head dim {head_dim}"),
            ));
        }
        let sections = self.rope_sections(n_rot)?;
        let freq_base = self
            .f
            .get_f32(&self.key("rope.freq_base"))?
            .unwrap_or(10000.0);
        if !(freq_base.is_finite() && freq_base > 0.0) {
            return Err(self.bad(
                "rope.freq_base",
                format!("{freq_base} must be a finite positive number"),
            ));
        }
        Ok(Rope {
            n_rot,
            sections,
            freq_base,
            scaling: self.rope_scaling()?,
        })
    }

    fn rope_sections(&self, n_rot: usize) -> Result<[i32; 4], ModelError> {
        let sections_key = self.key("rope.dimension_sections");
        let sections = self
            .f
            .get_array(&sections_key)?
            .and_then(|a| a.as_i64_vec())
            .ok_or(ModelError::MissingKey(sections_key.clone()))?;
        if sections.len() != 4 {
            return Err(ModelError::BadValue {
                key: sections_key,
                why: format!("expected exactly 4 entries, found {}", sections.len()),
            });
        }
        // IMROPE gives each of the n_rot/2 rotated pairs to one section (docs/MODEL.md): the
        // sections must be non-negative and cover exactly those pairs.
        let sum: i64 = sections.iter().sum();
        if sections.iter().any(|&x| x < 0) || sum != (n_rot / 2) as i64 {
            return Err(ModelError::BadValue {
                key: sections_key,
                why: format!(
                    "{sections:?} must be non-negative and sum to rope.dimension_count / 2 = {}",
                    n_rot / 2
                ),
            });
        }
        Ok([
            sections[0] as i32,
            sections[1] as i32,
            sections[2] as i32,
            sections[3] as i32,
        ])
    }

    fn rope_scaling(&self) -> Result<RopeScaling, ModelError> {
        match self.f.get_str(&self.key("rope.scaling.type"))? {
            None | Some("linear") => {
                let factor = match self.f.get_f32(&self.key("rope.scaling.factor"))? {
                    Some(x) => Some(x),
                    None => self.f.get_f32(&self.key("rope.scale_linear"))?,
                };
                match factor {
                    Some(x) if !(x.is_finite() && x > 0.0) => Err(self.bad(
                        "rope.scaling.factor",
                        format!("{x} must be a finite positive number"),
                    )),
                    Some(x) if x != 1.0 => Ok(RopeScaling::Linear {
                        freq_scale: 1.0 / x,
                    }),
                    _ => Ok(RopeScaling::None),
                }
            }
            Some("none") => Ok(RopeScaling::None),
            Some(other) => Err(self.bad(
                "rope.scaling.type",
                format!("rope scaling '{other}' is not supported (only none and linear)"),
            )),
        }
    }

    fn delta_net(&self) -> Result<DeltaNetDims, ModelError> {
        let conv_kernel = self.req_u32("ssm.conv_kernel")?;
        let head_dim = self.req_u32("ssm.state_size")?;
        let k_heads = self.req_u32("ssm.group_count")?;
        let v_heads = self.req_u32("ssm.time_step_rank")?;
        let inner = self.req_u32("ssm.inner_size")?;
        if conv_kernel < 1 || head_dim == 0 || k_heads == 0 || v_heads == 0 {
            return Err(self.bad("ssm.*", "zero-sized delta-net dimension"));
        }
        if inner != v_heads * head_dim {
            return Err(self.bad(
                "ssm.inner_size",
                format!("{inner} is not time_step_rank {v_heads} × state_size {head_dim}"),
            ));
        }
        if v_heads % k_heads != 0 {
            return Err(self.bad(
                "ssm.time_step_rank",
                format!("{v_heads} v heads is not a multiple of group_count {k_heads}"),
            ));
        }
        Ok(DeltaNetDims {
            conv_kernel,
            head_dim,
            k_heads,
            v_heads,
            inner,
        })
    }

    /// The kind of each of the `n_layer` trunk layers: from `attention.recurrent_layers` flags,
    /// else every `full_attention_interval`-th layer full attention.
    fn layer_kinds(&self, n_layer: usize) -> Result<Vec<LayerKind>, ModelError> {
        if let Some(MetadataValue::Array(arr)) = self.f.get(&self.key("attention.recurrent_layers"))
        {
            let flags = arr
                .as_u64_vec()
                .or_else(|| {
                    arr.as_bools()
                        .map(|b| b.iter().map(|&x| x as u64).collect())
                })
                .ok_or_else(|| {
                    self.bad("attention.recurrent_layers", "expected an array of flags")
                })?;
            if flags.len() < n_layer {
                return Err(self.bad(
                    "attention.recurrent_layers",
                    format!("{} entries for {n_layer} layers", flags.len()),
                ));
            }
            return Ok(flags[..n_layer]
                .iter()
                .map(|&r| {
                    if r != 0 {
                        LayerKind::DeltaNet
                    } else {
                        LayerKind::FullAttention
                    }
                })
                .collect());
        }
        let interval = self.opt_u32("full_attention_interval")?.unwrap_or(4);
        if interval == 0 {
            return Err(self.bad("full_attention_interval", "is 0"));
        }
        Ok((0..n_layer)
            .map(|il| {
                if (il + 1) % interval == 0 {
                    LayerKind::FullAttention
                } else {
                    LayerKind::DeltaNet
                }
            })
            .collect())
    }

    /// A MoE model's experts; the widths default from the first layer's dense width `n_ff0`.
    fn experts(&self, n_ff0: usize) -> Result<Experts, ModelError> {
        let n_expert = self.req_u32("expert_count")?;
        let n_used = self.req_u32("expert_used_count")?;
        if n_used == 0 || n_used > n_expert {
            return Err(self.bad(
                "expert_used_count",
                format!("{n_used} with {n_expert} experts"),
            ));
        }
        Ok(Experts {
            n_expert,
            n_expert_used: n_used,
            n_ff_exp: self
                .opt_u32("expert_feed_forward_length")?
                .unwrap_or(n_ff0 / n_used),
            n_ff_shexp: self
                .opt_u32("expert_shared_feed_forward_length")?
                .unwrap_or(n_ff0),
        })
    }
}
