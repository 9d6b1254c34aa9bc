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
//! | tokens | the committed tokens, positions `0..n`; an image's rows hold its placeholder ids |
//! | images (version 2) | count (u64); when any, the vision tower's fingerprint (u64), then per image its first row, rows and rotary positions (u64 each) |
//! | attention rows | per attention layer, positions `0..n` |
//! | recurrent snapshot | every delta-net layer's conv window and delta-rule state after `n` |
//! | NextN head state | when present |
//! | checksum (u64) | FNV-1a of everything before it |

use nextn_gguf::Fnv1a;
use nextn_model::{
    ImageSpan, KvRows, KvType, Model, ModelError, NextnHead, RecurrentSnapshot, SequenceState,
    StateCodecError, StateReader, StateWriter,
};

use crate::media::is_image_token;
use crate::speculative::draft::{HeadState, HeadStateError};

pub const MAGIC: [u8; 8] = *b"NEXTNSLT";
/// Version 2 adds the images; version 1 files (text only) are still read.
pub const VERSION: u32 = 2;
const TEXT_ONLY_VERSION: u32 = 1;

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
    #[error("the slot file holds {n} image(s), which need a vision projector (start with --mmproj, the one it was saved with)")]
    NoVision { n: usize },
    #[error("the slot file holds {n} image(s) encoded by another vision projector or other --image-min-tokens / --image-max-tokens (fingerprint {file:016x}; this server's is {this:016x})")]
    ForeignVision { n: usize, file: u64, this: u64 },
    #[error("the slot file is damaged: image {index} at rows {start}..{end} {why}")]
    BadImage {
        index: usize,
        start: u64,
        end: u64,
        why: &'static str,
    },
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
    /// The images among the tokens, in order: their rows and the rotary positions they took.
    pub images: Vec<ImageSpan>,
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
            images: state.images.clone(),
        })
    }

    /// The file's bytes. `vision` is the fingerprint of the tower that encoded the images
    /// ([`nextn_vision::VisionTower::fingerprint`]).
    pub fn encode(
        &self,
        identity: &ModelIdentity,
        k_type: KvType,
        v_type: KvType,
        vision: Option<u64>,
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
        w.u64(self.images.len() as u64);
        if !self.images.is_empty() {
            w.u64(vision.unwrap_or(0));
            for im in &self.images {
                w.u64(im.start as u64);
                w.u64(im.n_tokens as u64);
                w.u64(im.n_pos as u64);
            }
        }
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
        if version != VERSION && version != TEXT_ONLY_VERSION {
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
        let images = if version == TEXT_ONLY_VERSION {
            Vec::new()
        } else {
            read_images(&mut r, &tokens, target.vision)?
        };
        let n_vocab = target.model.n_vocab;
        // Image rows hold placeholder ids (checked above); every other row a vocabulary token.
        let mut in_image = vec![false; tokens.len()];
        for im in &images {
            in_image[im.start..im.start + im.n_tokens].fill(true);
        }
        if let Some((&token, _)) = tokens
            .iter()
            .zip(&in_image)
            .find(|&(&t, &image)| !image && t as usize >= n_vocab)
        {
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
                    // The head took every image's rows, as the target did.
                    images.iter().map(|im| im.n_tokens - im.n_pos).sum(),
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
            images,
        })
    }

    /// A fresh sequence of `target`'s model resumed at this state, checking that every layer
    /// fits the model.
    pub fn resume(&self, target: &Target<'_>) -> Result<SequenceState, SlotFileError> {
        let mut state = target
            .model
            .new_sequence(target.n_ctx, target.k_type, target.v_type)?;
        state.restore(std::iter::once(&self.rows[..]), &self.recurrent)?;
        state.images = self.images.clone();
        Ok(state)
    }
}

/// The images section of a version 2 file: each image inside the tokens, after the one before,
/// its rows all placeholder ids and no placeholder id outside an image; a file with images needs
/// the tower that encoded them.
fn read_images(
    r: &mut StateReader<'_>,
    tokens: &[u32],
    vision: Option<u64>,
) -> Result<Vec<ImageSpan>, SlotFileError> {
    let n = r.count("image count")?;
    if n > 0 {
        // Each image takes three u64s, after the fingerprint.
        if n as u64 > r.remaining() as u64 / 24 {
            return Err(StateCodecError::Invalid {
                what: "image count",
                value: n as u64,
            }
            .into());
        }
        let file = r.u64("vision fingerprint")?;
        match vision {
            None => return Err(SlotFileError::NoVision { n }),
            Some(this) if this != file => {
                return Err(SlotFileError::ForeignVision { n, file, this })
            }
            Some(_) => {}
        }
    }
    let mut images = Vec::with_capacity(n);
    let mut next = 0u64;
    for index in 0..n {
        let start = r.u64("image start")?;
        let rows = r.u64("image rows")?;
        let n_pos = r.u64("image positions")?;
        let end = start.saturating_add(rows);
        let bad = |why| SlotFileError::BadImage {
            index,
            start,
            end,
            why,
        };
        if start < next {
            return Err(bad("overlaps the image before it"));
        }
        if rows == 0 || end > tokens.len() as u64 {
            return Err(bad("is not inside the tokens"));
        }
        if n_pos == 0 || n_pos > rows {
            return Err(bad(
                "advances the rotary position by more than its rows or by none",
            ));
        }
        // In range of `tokens.len()`, so these fit in usize.
        let (s, e) = (start as usize, end as usize);
        if !tokens[s..e].iter().all(|&t| is_image_token(t)) {
            return Err(bad("holds text tokens"));
        }
        if tokens[next as usize..s].iter().any(|&t| is_image_token(t)) {
            return Err(bad("leaves image rows before it without an image"));
        }
        images.push(ImageSpan {
            start: s,
            n_tokens: rows as usize,
            n_pos: n_pos as usize,
        });
        next = end;
    }
    if tokens[next as usize..].iter().any(|&t| is_image_token(t)) {
        return Err(SlotFileError::BadImage {
            index: n,
            start: next,
            end: tokens.len() as u64,
            why: "is missing: these rows hold image ids but the file lists no image there",
        });
    }
    Ok(images)
}

/// What a slot file must fit: the model, its head when drafting, the KV types, the context.
pub struct Target<'m> {
    pub model: &'m Model,
    pub head: Option<&'m NextnHead>,
    pub identity: &'m ModelIdentity,
    /// The vision tower's fingerprint, when one is loaded.
    pub vision: Option<u64>,
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
