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
        let a = arch_name.to_string();
        let key = |k: &str| format!("{a}.{k}");
        let req_u32 = |k: &str| -> Result<usize, ModelError> {
            let name = key(k);
            f.get_u32(&name)?
                .map(|v| v as usize)
                .ok_or(ModelError::MissingKey(name))
        };
        let opt_u32 = |k: &str| -> Result<Option<usize>, ModelError> {
            Ok(f.get_u32(&key(k))?.map(|v| v as usize))
        };

        let n_ctx_train = req_u32("context_length")?;
        if n_ctx_train < MIN_CONTEXT {
            return Err(ModelError::BadValue {
                key: key("context_length"),
                why: format!(
                    "{n_ctx_train} positions; a model needs at least {MIN_CONTEXT} to hold a prompt and its answer"
                ),
            });
        }
        let n_embd = req_u32("embedding_length")?;
        let n_layer_all = req_u32("block_count")?;
        // Everything per layer is sized by block_count, so it must match the layers the file
        // actually holds before anything is allocated from it.
        if let Some(held) = held_layers.filter(|&held| held != n_layer_all) {
            return Err(ModelError::BadValue {
                key: key("block_count"),
                why: format!(
                    "{n_layer_all}, but the file's tensors are for {held} layers (blk.0 .. blk.{})",
                    held.saturating_sub(1)
                ),
            });
        }
        let n_nextn = opt_u32("nextn_predict_layers")?.unwrap_or(0);
        if n_layer_all == 0 || n_nextn >= n_layer_all {
            return Err(ModelError::BadValue {
                key: key("nextn_predict_layers"),
                why: format!("{n_nextn} must be smaller than block_count {n_layer_all}"),
            });
        }
        let n_layer = n_layer_all - n_nextn;

        let per_layer = |k: &str, default: Option<usize>| -> Result<Vec<usize>, ModelError> {
            let name = key(k);
            match f.get(&name) {
                None => match default {
                    Some(d) => file_sized_vec(&name, n_layer_all, d),
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
                    if vals.len() != n_layer_all {
                        return Err(ModelError::BadValue {
                            key: name,
                            why: format!(
                                "array has {} entries, block_count is {n_layer_all}",
                                vals.len()
                            ),
                        });
                    }
                    Ok(vals.into_iter().map(|v| v as usize).collect())
                }
                Some(_) => {
                    let v = f
                        .get_u32(&name)?
                        .ok_or_else(|| ModelError::MissingKey(name.clone()))?;
                    file_sized_vec(&name, n_layer_all, v as usize)
                }
            }
        };

        let n_head = per_layer("attention.head_count", None)?;
        let n_head_kv = match f.get(&key("attention.head_count_kv")) {
            None => n_head.clone(),
            Some(_) => per_layer("attention.head_count_kv", None)?,
        };
        let n_head0 = n_head.first().copied().unwrap_or(0);
        if n_head0 == 0 {
            return Err(ModelError::BadValue {
                key: key("attention.head_count"),
                why: "is 0".into(),
            });
        }
        let head_dim = opt_u32("attention.key_length")?.unwrap_or(n_embd / n_head0);
        let v_dim = opt_u32("attention.value_length")?.unwrap_or(n_embd / n_head0);
        if head_dim != v_dim {
            return Err(ModelError::BadValue {
                key: key("attention.value_length"),
                why: format!("{v_dim} differs from key_length {head_dim}"),
            });
        }
        let n_ff = per_layer("feed_forward_length", Some(0))?;
        let rms_eps =
            f.get_f32(&key("attention.layer_norm_rms_epsilon"))?
                .ok_or(ModelError::MissingKey(key(
                    "attention.layer_norm_rms_epsilon",
                )))?;
        let eps_key = key("attention.layer_norm_rms_epsilon");
        if !(rms_eps.is_finite() && rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(ModelError::BadValue {
                key: eps_key,
                why: format!("{rms_eps} must be a finite number between 0 and 1 (exclusive)"),
            });
        }
        let n_rot = opt_u32("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::BadValue {
                key: key("rope.dimension_count"),
                why: format!("{n_rot} must be even, positive and at most the head dim {head_dim}"),
            });
        }
        let sections_key = key("rope.dimension_sections");
        let sections = f
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
        let rope_sections = [
            sections[0] as i32,
            sections[1] as i32,
            sections[2] as i32,
            sections[3] as i32,
        ];
        let rope_freq_base = f.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0);
        if !(rope_freq_base.is_finite() && rope_freq_base > 0.0) {
            return Err(ModelError::BadValue {
                key: key("rope.freq_base"),
                why: format!("{rope_freq_base} must be a finite positive number"),
            });
        }
        let rope_scaling = match f.get_str(&key("rope.scaling.type"))? {
            None | Some("linear") => {
                let factor = match f.get_f32(&key("rope.scaling.factor"))? {
                    Some(x) => Some(x),
                    None => f.get_f32(&key("rope.scale_linear"))?,
                };
                match factor {
                    Some(x) if !(x.is_finite() && x > 0.0) => {
                        return Err(ModelError::BadValue {
                            key: key("rope.scaling.factor"),
                            why: format!("{x} must be a finite positive number"),
                        })
                    }
                    Some(x) if x != 1.0 => RopeScaling::Linear {
                        freq_scale: 1.0 / x,
                    },
                    _ => RopeScaling::None,
                }
            }
            Some("none") => RopeScaling::None,
            Some(other) => {
                return Err(ModelError::BadValue {
                    key: key("rope.scaling.type"),
                    why: format!("rope scaling '{other}' is not supported (only none and linear)"),
                })
            }
        };

        let conv_kernel = req_u32("ssm.conv_kernel")?;
        let ssm_head_dim = req_u32("ssm.state_size")?;
        let ssm_k_heads = req_u32("ssm.group_count")?;
        let ssm_v_heads = req_u32("ssm.time_step_rank")?;
        let ssm_inner = req_u32("ssm.inner_size")?;
        if conv_kernel < 1 || ssm_head_dim == 0 || ssm_k_heads == 0 || ssm_v_heads == 0 {
            return Err(ModelError::BadValue {
                key: key("ssm.*"),
                why: "zero-sized delta-net dimension".into(),
            });
        }
        if ssm_inner != ssm_v_heads * ssm_head_dim {
            return Err(ModelError::BadValue {
                key: key("ssm.inner_size"),
                why: format!(
                    "{ssm_inner} is not time_step_rank {ssm_v_heads} × state_size {ssm_head_dim}"
                ),
            });
        }
        if ssm_v_heads % ssm_k_heads != 0 {
            return Err(ModelError::BadValue {
                key: key("ssm.time_step_rank"),
                why: format!(
                    "{ssm_v_heads} v heads is not a multiple of group_count {ssm_k_heads}"
                ),
            });
        }

        let layer_kinds = match f.get(&key("attention.recurrent_layers")) {
            Some(MetadataValue::Array(arr)) => {
                let flags = arr
                    .as_u64_vec()
                    .or_else(|| {
                        arr.as_bools()
                            .map(|b| b.iter().map(|&x| x as u64).collect())
                    })
                    .ok_or_else(|| ModelError::BadValue {
                        key: key("attention.recurrent_layers"),
                        why: "expected an array of flags".into(),
                    })?;
                if flags.len() < n_layer {
                    return Err(ModelError::BadValue {
                        key: key("attention.recurrent_layers"),
                        why: format!("{} entries for {n_layer} layers", flags.len()),
                    });
                }
                flags[..n_layer]
                    .iter()
                    .map(|&r| {
                        if r != 0 {
                            LayerKind::DeltaNet
                        } else {
                            LayerKind::FullAttention
                        }
                    })
                    .collect()
            }
            _ => {
                let interval = opt_u32("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(ModelError::BadValue {
                        key: key("full_attention_interval"),
                        why: "is 0".into(),
                    });
                }
                (0..n_layer)
                    .map(|il| {
                        if (il + 1) % interval == 0 {
                            LayerKind::FullAttention
                        } else {
                            LayerKind::DeltaNet
                        }
                    })
                    .collect()
            }
        };

        let (n_expert, n_expert_used, n_ff_exp, n_ff_shexp) = match arch {
            Arch::Dense => (0, 0, 0, 0),
            Arch::Moe => {
                let n_expert = req_u32("expert_count")?;
                let n_used = req_u32("expert_used_count")?;
                if n_used == 0 || n_used > n_expert {
                    return Err(ModelError::BadValue {
                        key: key("expert_used_count"),
                        why: format!("{n_used} with {n_expert} experts"),
                    });
                }
                let n_ff0 = n_ff.first().copied().unwrap_or(0);
                let n_ff_exp = opt_u32("expert_feed_forward_length")?.unwrap_or(n_ff0 / n_used);
                let n_ff_shexp = opt_u32("expert_shared_feed_forward_length")?.unwrap_or(n_ff0);
                (n_expert, n_used, n_ff_exp, n_ff_shexp)
            }
        };

        for (il, (&h, &hkv)) in n_head.iter().zip(&n_head_kv).enumerate() {
            if h == 0 || hkv == 0 || h % hkv != 0 {
                return Err(ModelError::BadValue {
                    key: key("attention.head_count_kv"),
                    why: format!("layer {il}: {h} heads is not a multiple of {hkv} kv heads"),
                });
            }
        }

        Ok(Qwen35Config {
            arch,
            n_ctx_train,
            n_embd,
            n_layer_all,
            n_layer,
            n_nextn,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            rms_eps,
            n_rot,
            rope_sections,
            rope_freq_base,
            rope_scaling,
            conv_kernel,
            ssm_head_dim,
            ssm_k_heads,
            ssm_v_heads,
            ssm_inner,
            layer_kinds,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
        })
    }
}
