//! What a synthesized model looks like: its hyper-parameters, the named presets with the shapes of
//! real Qwen3.5 / Qwen3.6 checkpoints, and the GGUF metadata that describes them (docs/MODEL.md,
//! "GGUF metadata").

use nextn_gguf::{MetadataArray, MetadataValue};

use super::plan::FileType;
use super::vocab::Vocab;
use super::SynthError;
use crate::config::{Arch, Qwen35Config};

/// Hyper-parameters of a synthesized `qwen35` / `qwen35moe` model.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    pub arch: Arch,
    /// `general.name`.
    pub name: String,
    pub n_embd: usize,
    /// Trunk layers (without the NextN block).
    pub n_layer: usize,
    /// NextN (MTP) blocks after the trunk: 0 or 1.
    pub n_nextn: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dims per head (`rope.dimension_count`).
    pub n_rot: usize,
    /// Dense FFN width (`qwen35`); unused by `qwen35moe`.
    pub n_ff: usize,
    pub ssm_k_heads: usize,
    pub ssm_v_heads: usize,
    /// dk = dv (`ssm.state_size`).
    pub ssm_head_dim: usize,
    pub conv_kernel: usize,
    /// Layer `il` is full attention iff `(il + 1) % interval == 0`.
    pub full_attention_interval: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_ff_shexp: usize,
    pub n_vocab: usize,
    /// No `output.weight`: the LM head is `token_embd`.
    pub tied: bool,
    pub n_ctx_train: usize,
    pub rope_freq_base: f32,
    pub rms_eps: f32,
}

/// The vocabulary size of every real Qwen3.5 / Qwen3.6 checkpoint (248,077 tokens padded).
pub const QWEN35_N_VOCAB: usize = 248_320;

/// Names accepted by [`SynthSpec::preset`].
pub const PRESETS: &[&str] = &[
    "0.8b",
    "27b",
    "35b-a3b",
    "35b-a3b-small",
    "tiny",
    "tiny-moe",
];

fn dense(name: &str) -> SynthSpec {
    SynthSpec {
        arch: Arch::Dense,
        name: name.to_owned(),
        n_embd: 1024,
        n_layer: 24,
        n_nextn: 1,
        n_head: 8,
        n_head_kv: 2,
        head_dim: 256,
        n_rot: 64,
        n_ff: 3584,
        ssm_k_heads: 16,
        ssm_v_heads: 16,
        ssm_head_dim: 128,
        conv_kernel: 4,
        full_attention_interval: 4,
        n_expert: 0,
        n_expert_used: 0,
        n_ff_exp: 0,
        n_ff_shexp: 0,
        n_vocab: QWEN35_N_VOCAB,
        tied: true,
        n_ctx_train: 262_144,
        rope_freq_base: 1e7,
        rms_eps: 1e-6,
    }
}

fn moe_35b_a3b(name: &str, n_layer: usize) -> SynthSpec {
    SynthSpec {
        arch: Arch::Moe,
        n_embd: 2048,
        n_layer,
        n_head: 16,
        n_head_kv: 2,
        n_ff: 0,
        ssm_v_heads: 32,
        n_expert: 256,
        n_expert_used: 8,
        n_ff_exp: 512,
        n_ff_shexp: 512,
        tied: false,
        ..dense(name)
    }
}

impl SynthSpec {
    /// A named shape. `0.8b`: Qwen3.5-0.8B. `27b`: Qwen3.6-27B. `35b-a3b`: Qwen3.6-35B-A3B.
    /// `35b-a3b-small`: the 35B-A3B layer shapes with 4 trunk layers (one of them full attention),
    /// small enough to run on a 24 GiB machine. `tiny` / `tiny-moe`: test-sized, 4096 tokens.
    pub fn preset(name: &str) -> Option<SynthSpec> {
        let full_name = format!("synth-qwen35-{name}");
        Some(match name {
            "0.8b" => dense(&full_name),
            "27b" => SynthSpec {
                n_embd: 5120,
                n_layer: 64,
                n_head: 24,
                n_head_kv: 4,
                n_ff: 17408,
                ssm_v_heads: 48,
                tied: false,
                ..dense(&full_name)
            },
            "35b-a3b" => moe_35b_a3b(&full_name, 40),
            "35b-a3b-small" => moe_35b_a3b(&full_name, 4),
            "tiny" => SynthSpec {
                n_embd: 128,
                n_layer: 4,
                n_head: 2,
                n_head_kv: 1,
                head_dim: 64,
                n_rot: 16,
                n_ff: 384,
                ssm_k_heads: 2,
                ssm_v_heads: 4,
                ssm_head_dim: 32,
                n_vocab: 4096,
                n_ctx_train: 4096,
                ..dense(&full_name)
            },
            "tiny-moe" => SynthSpec {
                arch: Arch::Moe,
                name: full_name,
                n_ff: 0,
                n_expert: 8,
                n_expert_used: 2,
                n_ff_exp: 64,
                n_ff_shexp: 128,
                tied: false,
                ..SynthSpec::preset("tiny")?
            },
            _ => return None,
        })
    }

    /// The shape of an existing model (from its configuration), for files that must match one.
    pub fn from_config(cfg: &Qwen35Config, n_vocab: usize, tied: bool) -> SynthSpec {
        SynthSpec {
            arch: cfg.arch,
            name: "synth-qwen35-like".to_owned(),
            n_embd: cfg.n_embd,
            n_layer: cfg.n_layer,
            n_nextn: cfg.n_nextn,
            n_head: cfg.n_head.first().copied().unwrap_or(0),
            n_head_kv: cfg.n_head_kv.first().copied().unwrap_or(0),
            head_dim: cfg.head_dim,
            n_rot: cfg.n_rot,
            n_ff: cfg.n_ff.first().copied().unwrap_or(0),
            ssm_k_heads: cfg.ssm_k_heads,
            ssm_v_heads: cfg.ssm_v_heads,
            ssm_head_dim: cfg.ssm_head_dim,
            conv_kernel: cfg.conv_kernel,
            full_attention_interval: cfg
                .layer_kinds
                .iter()
                .position(|k| *k == crate::config::LayerKind::FullAttention)
                .map_or(cfg.n_layer + 1, |i| i + 1),
            n_expert: cfg.n_expert,
            n_expert_used: cfg.n_expert_used,
            n_ff_exp: cfg.n_ff_exp,
            n_ff_shexp: cfg.n_ff_shexp,
            n_vocab,
            tied,
            n_ctx_train: cfg.n_ctx_train,
            rope_freq_base: cfg.rope_freq_base,
            rms_eps: cfg.rms_eps,
        }
    }

    /// `block_count`: trunk plus NextN layers.
    pub fn n_layer_all(&self) -> usize {
        self.n_layer + self.n_nextn
    }

    pub fn key_dim(&self) -> usize {
        self.ssm_k_heads * self.ssm_head_dim
    }

    /// value_dim = Hv·dv (`ssm.inner_size`).
    pub fn value_dim(&self) -> usize {
        self.ssm_v_heads * self.ssm_head_dim
    }

    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Whether block `il` is a full-attention block (the NextN block always is).
    pub fn is_full_attention(&self, il: usize) -> bool {
        il >= self.n_layer || (il + 1).is_multiple_of(self.full_attention_interval)
    }

    /// M-RoPE sections `[t, h, w, e]` covering the `n_rot / 2` rotated pairs: the converter's
    /// `[11, 11, 10, 0]` for the real 64 rotated dims, scaled the same way otherwise. For text all
    /// three position components are equal, so only the total matters.
    pub fn rope_sections(&self) -> [i32; 4] {
        let pairs = self.n_rot / 2;
        let t = (pairs * 11 + 16) / 32;
        let h = ((pairs * 11 + 16) / 32).min(pairs - t);
        [t as i32, h as i32, (pairs - t - h) as i32, 0]
    }

    /// Refuses shapes llama.cpp (or our loader) would refuse, naming the option at fault.
    pub fn validate(&self) -> Result<(), SynthError> {
        let bad = |field: &'static str, why: String| Err(SynthError::BadSpec { field, why });
        let positive: [(&'static str, usize); 9] = [
            ("hidden", self.n_embd),
            ("layers", self.n_layer),
            ("heads", self.n_head),
            ("kv-heads", self.n_head_kv),
            ("head-dim", self.head_dim),
            ("ssm-k-heads", self.ssm_k_heads),
            ("ssm-v-heads", self.ssm_v_heads),
            ("ssm-head-dim", self.ssm_head_dim),
            ("conv-kernel", self.conv_kernel),
        ];
        for (field, v) in positive {
            if v == 0 {
                return bad(field, "must be positive".into());
            }
        }
        if self.n_nextn > 1 {
            return bad(
                "mtp",
                format!(
                    "{} NextN layers: llama.cpp's qwen35 graph supports exactly one",
                    self.n_nextn
                ),
            );
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(
                "kv-heads",
                format!(
                    "{} query heads are not a multiple of {} kv heads",
                    self.n_head, self.n_head_kv
                ),
            );
        }
        if !self.ssm_v_heads.is_multiple_of(self.ssm_k_heads) {
            return bad(
                "ssm-v-heads",
                format!(
                    "{} v heads are not a multiple of {} k heads",
                    self.ssm_v_heads, self.ssm_k_heads
                ),
            );
        }
        if self.n_rot == 0 || !self.n_rot.is_multiple_of(2) || self.n_rot > self.head_dim {
            return bad(
                "rope-dim",
                format!(
                    "{} must be even, positive and at most head-dim {}",
                    self.n_rot, self.head_dim
                ),
            );
        }
        if self.full_attention_interval == 0 {
            return bad("full-attention-interval", "must be positive".into());
        }
        match self.arch {
            Arch::Dense if self.n_ff == 0 => {
                return bad("ff", "a dense model needs a positive FFN width".into())
            }
            Arch::Moe => {
                if self.n_expert == 0 || self.n_ff_exp == 0 {
                    return bad(
                        "experts",
                        "an MoE model needs experts and a positive expert-ff".into(),
                    );
                }
                if self.n_expert_used == 0 || self.n_expert_used > self.n_expert {
                    return bad(
                        "experts-used",
                        format!("{} of {} experts", self.n_expert_used, self.n_expert),
                    );
                }
            }
            Arch::Dense => {}
        }
        if self.n_vocab < super::vocab::MIN_N_VOCAB {
            return bad(
                "vocab",
                format!(
                    "{} tokens: at least {} (256 bytes + 3 control tokens)",
                    self.n_vocab,
                    super::vocab::MIN_N_VOCAB
                ),
            );
        }
        if self.n_ctx_train == 0 {
            return bad("ctx", "must be positive".into());
        }
        Ok(())
    }

    /// Total parameter count (what the plan will write), for size estimates.
    pub fn n_params(&self) -> u64 {
        super::plan::tensor_shapes(self)
            .iter()
            .map(|t| t.dims.iter().product::<u64>())
            .sum()
    }

    /// The GGUF metadata of the synthesized file, in the order llama.cpp's converter writes it.
    pub fn metadata(
        &self,
        ftype: FileType,
        vocab: &Vocab,
        seed: u64,
    ) -> Vec<(String, MetadataValue)> {
        let a = self.arch.name();
        let mut kv: Vec<(String, MetadataValue)> = Vec::new();
        let mut put = |k: String, v: MetadataValue| kv.push((k, v));
        let u = |x: usize| MetadataValue::U32(x as u32);
        put("general.architecture".into(), a.into());
        put("general.name".into(), self.name.as_str().into());
        put(
            "general.description".into(),
            format!("random weights (nextn synth, seed {seed}) with real Qwen3.5 shapes; not a trained model").into(),
        );
        put(format!("{a}.context_length"), u(self.n_ctx_train));
        put(format!("{a}.embedding_length"), u(self.n_embd));
        put(format!("{a}.block_count"), u(self.n_layer_all()));
        if self.n_nextn > 0 {
            put(format!("{a}.nextn_predict_layers"), u(self.n_nextn));
        }
        if self.arch == Arch::Dense {
            put(format!("{a}.feed_forward_length"), u(self.n_ff));
        }
        put(format!("{a}.attention.head_count"), u(self.n_head));
        put(format!("{a}.attention.head_count_kv"), u(self.n_head_kv));
        put(format!("{a}.attention.key_length"), u(self.head_dim));
        put(format!("{a}.attention.value_length"), u(self.head_dim));
        put(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            MetadataValue::F32(self.rms_eps),
        );
        put(format!("{a}.rope.dimension_count"), u(self.n_rot));
        put(
            format!("{a}.rope.dimension_sections"),
            MetadataArray::I32(self.rope_sections().to_vec()).into(),
        );
        put(
            format!("{a}.rope.freq_base"),
            MetadataValue::F32(self.rope_freq_base),
        );
        put(format!("{a}.ssm.conv_kernel"), u(self.conv_kernel));
        put(format!("{a}.ssm.state_size"), u(self.ssm_head_dim));
        put(format!("{a}.ssm.group_count"), u(self.ssm_k_heads));
        put(format!("{a}.ssm.time_step_rank"), u(self.ssm_v_heads));
        put(format!("{a}.ssm.inner_size"), u(self.value_dim()));
        put(
            format!("{a}.full_attention_interval"),
            u(self.full_attention_interval),
        );
        if self.arch == Arch::Moe {
            put(format!("{a}.expert_count"), u(self.n_expert));
            put(format!("{a}.expert_used_count"), u(self.n_expert_used));
            put(format!("{a}.expert_feed_forward_length"), u(self.n_ff_exp));
            put(
                format!("{a}.expert_shared_feed_forward_length"),
                u(self.n_ff_shexp),
            );
        }
        put(
            "general.file_type".into(),
            MetadataValue::U32(ftype.llama_ftype()),
        );
        if ftype.is_quantized() {
            put("general.quantization_version".into(), MetadataValue::U32(2));
        }
        kv.extend(vocab.metadata());
        kv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_named() {
        for name in PRESETS {
            let s = SynthSpec::preset(name).expect(name);
            s.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(s.name.ends_with(name));
        }
        assert!(SynthSpec::preset("7b").is_none());
    }

    #[test]
    fn real_shapes() {
        let s = SynthSpec::preset("0.8b").unwrap();
        assert_eq!(
            (s.n_embd, s.n_layer_all(), s.conv_dim(), s.value_dim()),
            (1024, 25, 6144, 2048)
        );
        assert_eq!(s.rope_sections(), [11, 11, 10, 0]);
        assert!(s.tied);
        let s = SynthSpec::preset("27b").unwrap();
        assert_eq!((s.conv_dim(), s.value_dim(), s.tied), (10240, 6144, false));
        let s = SynthSpec::preset("35b-a3b").unwrap();
        assert_eq!(
            (s.conv_dim(), s.value_dim(), s.n_layer_all()),
            (8192, 4096, 41)
        );
        // 27B: ~27e9 parameters incl. the MTP block and both vocab matrices.
        let p = SynthSpec::preset("27b").unwrap().n_params();
        assert!((26_000_000_000..29_000_000_000).contains(&p), "{p}");
        let p = SynthSpec::preset("35b-a3b").unwrap().n_params();
        assert!((34_000_000_000..37_000_000_000).contains(&p), "{p}");
    }

    #[test]
    fn rope_sections_cover_the_rotated_pairs() {
        for n_rot in [2usize, 8, 16, 32, 64, 128] {
            let s = SynthSpec {
                n_rot,
                head_dim: 256,
                ..SynthSpec::preset("0.8b").unwrap()
            };
            let sec = s.rope_sections();
            assert_eq!(
                sec.iter().sum::<i32>() as usize,
                n_rot / 2,
                "{n_rot}: {sec:?}"
            );
            assert!(sec.iter().all(|&x| x >= 0));
        }
    }

    #[test]
    fn validate_names_the_field() {
        let mut s = SynthSpec::preset("tiny").unwrap();
        s.n_head_kv = 3;
        assert!(matches!(
            s.validate(),
            Err(SynthError::BadSpec {
                field: "kv-heads",
                ..
            })
        ));
        let mut s = SynthSpec::preset("tiny-moe").unwrap();
        s.n_expert_used = 9;
        assert!(matches!(
            s.validate(),
            Err(SynthError::BadSpec {
                field: "experts-used",
                ..
            })
        ));
        let mut s = SynthSpec::preset("tiny").unwrap();
        s.n_vocab = 100;
        assert!(matches!(
            s.validate(),
            Err(SynthError::BadSpec { field: "vocab", .. })
        ));
    }
}
