//! Slot files: one sequence's committed state on disk, so that a conversation survives a restart
//! or moves to another process (`POST /slots/{id}?action=save|restore`, `nextn run
//! --prompt-cache`).
//!
//! Layout, little-endian (values as [`StateWriter`] writes them):
//!
//! | field | |
//! |---|---|
//! | magic `NEXTNSLT`, version (u32) | refused when another program or version wrote it |
//! | model fingerprint (u64), model name | refused when another model wrote it |
//! | K and V element types (ggml ids, u8 each), head present (u8) | |
//! | tokens | the committed tokens, positions `0..n` |
//! | attention rows | per attention layer, positions `0..n` |
//! | recurrent snapshot | every delta-net layer's conv window and delta-rule state after `n` |
//! | NextN head state | when present |
//! | checksum (u64) | FNV-1a of everything before it |

use nextn_gguf::Fnv1a;
use nextn_model::{
    KvRows, KvType, Model, ModelError, NextnHead, RecurrentSnapshot, SequenceState,
    StateCodecError, StateReader, StateWriter,
};

use crate::speculative::draft::{HeadState, HeadStateError};

pub const MAGIC: [u8; 8] = *b"NEXTNSLT";
pub const VERSION: u32 = 1;

/// Which model a state belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// [`nextn_gguf::GgufFile::fingerprint`] of the model file.
    pub fingerprint: u64,
    /// For messages: the model's `general.name`, else its architecture.
    pub name: String,
}

impl ModelIdentity {
    pub fn of(model: &Model) -> ModelIdentity {
        let name = model
            .file
            .get_str("general.name")
            .ok()
            .flatten()
            .map(str::to_string)
            .unwrap_or_else(|| model.config.arch.name().to_string());
        ModelIdentity {
            fingerprint: model.file.fingerprint(),
            name,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SlotFileError {
    #[error("not a nextn slot file (it does not start with the NEXTNSLT magic)")]
    NotASlotFile,
    #[error("slot file version {found} is not supported (this build reads version {supported})")]
    Version { found: u32, supported: u32 },
    #[error("the slot file is damaged: its checksum does not match its contents")]
    Checksum,
    #[error("the slot file was saved by another model ('{file}', fingerprint {file_fingerprint:016x}); this server runs '{this}' ({this_fingerprint:016x})")]
    ForeignModel {
        file: String,
        file_fingerprint: u64,
        this: String,
        this_fingerprint: u64,
    },
    #[error("the slot file holds a {file_k}/{file_v} KV cache, but this server's is {k}/{v} (-ctk/-ctv)")]
    KvTypes {
        file_k: &'static str,
        file_v: &'static str,
        k: &'static str,
        v: &'static str,
    },
    #[error("the slot file holds no NextN head state, which drafting with the head needs (save it with speculative decoding on)")]
    NoHeadState,
    #[error("the slot file holds {n} tokens, but a slot's context holds {n_ctx}")]
    TooLong { n: usize, n_ctx: usize },
    #[error("the slot file holds token id {token}, beyond the vocabulary of {n_vocab}")]
    TokenOutOfRange { token: u32, n_vocab: usize },
    #[error("the slot file is damaged: {0}")]
    Codec(#[from] StateCodecError),
    #[error("the slot file does not fit this model: {0}")]
    Model(#[from] ModelError),
    #[error("the slot file's head state does not fit this model: {0}")]
    Head(#[from] HeadStateError),
    #[error("the slot file is damaged: {what} {found}, expected {expected}")]
    Inconsistent {
        what: &'static str,
        expected: usize,
        found: usize,
    },
}

/// One sequence's committed state: everything needed to continue it exactly.
#[derive(Clone, Debug)]
pub struct SavedState {
    /// The committed tokens.
    pub tokens: Vec<u32>,
    /// The attention rows of positions `0..tokens.len()`, one entry per attention layer.
    pub rows: Vec<KvRows>,
    pub recurrent: RecurrentSnapshot,
    pub head: Option<HeadState>,
}

impl SavedState {
    /// A state taken from a sequence with no pending verify rows.
    pub fn of(
        tokens: Vec<u32>,
        state: &SequenceState,
        head: Option<HeadState>,
    ) -> Result<SavedState, ModelError> {
        let recurrent = state.recurrent_snapshot()?;
        Ok(SavedState {
            rows: state.attention_rows(0, state.n_past)?,
            tokens,
            recurrent,
            head,
        })
    }

    /// The file's bytes.
    pub fn encode(
        &self,
        identity: &ModelIdentity,
        k_type: KvType,
        v_type: KvType,
    ) -> Result<Vec<u8>, ModelError> {
        let mut w = StateWriter::new();
        w.bytes(&MAGIC);
        w.u32(VERSION);
        w.u64(identity.fingerprint);
        w.u64(identity.name.len() as u64);
        w.bytes(identity.name.as_bytes());
        w.u8(k_type.ggml_id());
        w.u8(v_type.ggml_id());
        w.u8(u8::from(self.head.is_some()));
        w.u32s(&self.tokens);
        w.u64(self.rows.len() as u64);
        for r in &self.rows {
            r.encode(&mut w);
        }
        self.recurrent.encode(&mut w);
        if let Some(h) = &self.head {
            h.encode(&mut w)?;
        }
        let mut sum = Fnv1a::new();
        sum.write(w.as_slice());
        w.u64(sum.finish());
        Ok(w.into_bytes())
    }

    /// Read a file written by [`SavedState::encode`] for this model and KV types. The attention
    /// rows and recurrent states are checked against the model when the state is resumed
    /// ([`SavedState::resume`]).
    pub fn decode(bytes: &[u8], target: &Target<'_>) -> Result<SavedState, SlotFileError> {
        if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
            return Err(SlotFileError::NotASlotFile);
        }
        let mut r = StateReader::new(&bytes[MAGIC.len()..]);
        let version = r.u32("version")?;
        if version != VERSION {
            return Err(SlotFileError::Version {
                found: version,
                supported: VERSION,
            });
        }
        let body_len = bytes.len().checked_sub(8).ok_or(SlotFileError::Checksum)?;
        if body_len < MAGIC.len() + 4 {
            return Err(SlotFileError::Checksum);
        }
        let (body, stored) = bytes.split_at(body_len);
        let mut sum = Fnv1a::new();
        sum.write(body);
        let stored = u64::from_le_bytes(stored.try_into().map_err(|_| SlotFileError::Checksum)?);
        if sum.finish() != stored {
            return Err(SlotFileError::Checksum);
        }
        let mut r = StateReader::new(&body[MAGIC.len() + 4..]);
        let fingerprint = r.u64("model fingerprint")?;
        let name_len = r.u64("model name")?;
        let name = String::from_utf8_lossy(r.take(name_len, "model name")?).into_owned();
        if fingerprint != target.identity.fingerprint {
            return Err(SlotFileError::ForeignModel {
                file: name,
                file_fingerprint: fingerprint,
                this: target.identity.name.clone(),
                this_fingerprint: target.identity.fingerprint,
            });
        }
        let kv_type = |id: u8, what: &'static str| {
            KvType::from_ggml_id(id).ok_or(StateCodecError::Invalid {
                what,
                value: u64::from(id),
            })
        };
        let file_k = kv_type(r.u8("K type")?, "K type")?;
        let file_v = kv_type(r.u8("V type")?, "V type")?;
        if (file_k, file_v) != (target.k_type, target.v_type) {
            return Err(SlotFileError::KvTypes {
                file_k: file_k.name(),
                file_v: file_v.name(),
                k: target.k_type.name(),
                v: target.v_type.name(),
            });
        }
        let has_head = r.u8("head flag")? != 0;
        if !has_head && target.head.is_some() {
            return Err(SlotFileError::NoHeadState);
        }
        let tokens = r.u32s("tokens")?;
        if tokens.len() >= target.n_ctx {
            return Err(SlotFileError::TooLong {
                n: tokens.len(),
                n_ctx: target.n_ctx,
            });
        }
        let n_vocab = target.model.n_vocab;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(SlotFileError::TokenOutOfRange { token, n_vocab });
        }
        let n_layers = r.u64("attention layer count")?;
        // Each layer's rows take at least their two lengths and two type bytes.
        if n_layers > r.remaining() as u64 / 18 {
            return Err(StateCodecError::Invalid {
                what: "attention layer count",
                value: n_layers,
            }
            .into());
        }
        let mut rows = Vec::with_capacity(n_layers as usize);
        for _ in 0..n_layers {
            let layer = KvRows::decode(&mut r)?;
            if layer.len() != tokens.len() {
                return Err(SlotFileError::Inconsistent {
                    what: "attention rows",
                    expected: tokens.len(),
                    found: layer.len(),
                });
            }
            rows.push(layer);
        }
        let recurrent = RecurrentSnapshot::decode(&mut r)?;
        if recurrent.n_past() != tokens.len() {
            return Err(SlotFileError::Inconsistent {
                what: "recurrent snapshot position",
                expected: tokens.len(),
                found: recurrent.n_past(),
            });
        }
        let head = if has_head {
            let decoded = match target.head {
                Some(h) => Some(HeadState::decode(
                    &mut r,
                    h,
                    target.model.config.n_embd,
                    target.k_type,
                    target.v_type,
                    target.n_ctx,
                )?),
                // A server without drafting has no use for the head's state.
                None => None,
            };
            if decoded
                .as_ref()
                .is_some_and(|h| h.covered() != tokens.len())
            {
                return Err(SlotFileError::Inconsistent {
                    what: "head positions",
                    expected: tokens.len(),
                    found: decoded.as_ref().map_or(0, HeadState::covered),
                });
            }
            decoded
        } else {
            None
        };
        // Without a head of its own, a server leaves a saved head state unread.
        if (target.head.is_some() || !has_head) && r.remaining() != 0 {
            return Err(SlotFileError::Inconsistent {
                what: "bytes after the state",
                expected: 0,
                found: r.remaining(),
            });
        }
        Ok(SavedState {
            tokens,
            rows,
            recurrent,
            head,
        })
    }

    /// A fresh sequence of `target`'s model resumed at this state, checking that every layer
    /// fits the model.
    pub fn resume(&self, target: &Target<'_>) -> Result<SequenceState, SlotFileError> {
        let mut state = target
            .model
            .new_sequence(target.n_ctx, target.k_type, target.v_type)?;
        state.restore(std::iter::once(&self.rows[..]), &self.recurrent)?;
        Ok(state)
    }
}

/// What a slot file must fit: the model, its head when drafting, the KV types, the context.
pub struct Target<'m> {
    pub model: &'m Model,
    pub head: Option<&'m NextnHead>,
    pub identity: &'m ModelIdentity,
    pub k_type: KvType,
    pub v_type: KvType,
    pub n_ctx: usize,
}

/// Write `bytes` to `path` through a temporary file in the same directory, so that a reader
/// never sees half a file.
pub fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp: std::path::PathBuf = {
        let mut name = path
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        name.push(format!(".tmp{}", std::process::id()));
        path.with_file_name(name)
    };
    let result = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
