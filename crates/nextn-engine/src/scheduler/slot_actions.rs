//! Slot actions: what a free slot is asked to do with its kept state (`/slots` save, restore and
//! erase, slot files, the prompt cache of `nextn run`). They wait in the inbox until their slot is
//! free and run between steps on the inference thread.

use std::sync::mpsc;

use nextn_model::{ModelError, SequenceState};

use super::core::Core;
use super::slot_reuse::Kept;
use crate::prefix_cache::Snapshot;
use crate::slot_file::{ModelIdentity, SavedState, SlotFileError, Target};
use crate::speculative::draft::HeadState;

/// What a free slot is asked to do with its kept state.
pub enum SlotAction {
    /// Encode the kept state as a slot file.
    Save,
    /// Replace the kept state with a slot file's (and offer it to the prefix cache).
    Restore(Vec<u8>),
    /// Drop the kept state.
    Erase,
}

/// The answer to a [`SlotAction`].
#[derive(Debug)]
pub enum SlotActionDone {
    /// A slot file's bytes and the tokens it holds.
    Saved {
        bytes: Vec<u8>,
        n_tokens: usize,
    },
    Restored {
        n_tokens: usize,
    },
    Erased {
        n_tokens: usize,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum SlotActionError {
    #[error("slot {slot} does not exist (the server has {n_slots} slots)")]
    NoSuchSlot { slot: usize, n_slots: usize },
    #[error("cannot restore the slot file: {0}")]
    File(#[from] SlotFileError),
    #[error("cannot save slot {slot}: {why}")]
    Save { slot: usize, why: String },
    #[error("the server is shutting down")]
    ShuttingDown,
}

pub type SlotActionReply = mpsc::Sender<Result<SlotActionDone, SlotActionError>>;

/// A slot action waiting for its slot to be free.
pub struct SlotControl {
    pub slot: usize,
    pub action: SlotAction,
    pub reply: SlotActionReply,
}

impl<'e> Core<'e> {
    /// Run `f` with what a slot file must fit here.
    fn with_target<R>(&mut self, f: impl FnOnce(&Target<'_>) -> R) -> R {
        let model = self.engine.model;
        let identity: &ModelIdentity = self
            .identity
            .get_or_insert_with(|| ModelIdentity::of(model));
        let target = Target {
            model,
            head: self.spec.as_ref().and(self.engine.head),
            identity,
            vision: self.engine.vision.map(|t| t.fingerprint()),
            k_type: self.cfg.k_type,
            v_type: self.cfg.v_type,
            n_ctx: self.cfg.n_ctx_slot,
        };
        f(&target)
    }

    /// Run a slot action on a free slot.
    pub(super) fn run_slot_action(
        &mut self,
        slot: usize,
        action: SlotAction,
    ) -> Result<SlotActionDone, SlotActionError> {
        if slot >= self.slots.len() {
            return Err(SlotActionError::NoSuchSlot {
                slot,
                n_slots: self.slots.len(),
            });
        }
        let result = match action {
            SlotAction::Save => self.save_slot(slot),
            SlotAction::Restore(bytes) => {
                let saved = self.decode_state(&bytes)?;
                let state = self.resume_state(&saved)?;
                self.offer_to_prefix_cache(&saved);
                let n_tokens = saved.tokens.len();
                self.clock += 1;
                self.last_request[slot] = (0, 0, 0);
                self.kept[slot] = Some(Kept {
                    tokens: saved.tokens,
                    state,
                    head: saved.head,
                    freed_at: self.clock,
                });
                Ok(SlotActionDone::Restored { n_tokens })
            }
            SlotAction::Erase => {
                let n_tokens = self.kept[slot].take().map_or(0, |k| k.tokens.len());
                self.last_request[slot] = (0, 0, 0);
                Ok(SlotActionDone::Erased { n_tokens })
            }
        };
        self.publish_slots();
        result
    }

    fn save_slot(&mut self, slot: usize) -> Result<SlotActionDone, SlotActionError> {
        let (k_type, v_type) = (self.cfg.k_type, self.cfg.v_type);
        let no_room = |e: ModelError| SlotActionError::Save {
            slot,
            why: e.to_string(),
        };
        let saved = match &self.kept[slot] {
            Some(k) => {
                let head = k.head.as_ref().map(HeadState::try_clone).transpose();
                SavedState::of(k.tokens.clone(), &k.state, head.map_err(no_room)?)
            }
            None => {
                let fresh = self
                    .engine
                    .model
                    .new_sequence(self.cfg.n_ctx_slot, k_type, v_type)
                    .map_err(no_room)?;
                let head = match (&self.spec, self.engine.head) {
                    (Some(_), Some(h)) => Some(
                        HeadState::new(
                            h,
                            self.engine.model.config.n_embd,
                            k_type,
                            v_type,
                            self.cfg.n_ctx_slot,
                        )
                        .map_err(no_room)?,
                    ),
                    _ => None,
                };
                SavedState::of(Vec::new(), &fresh, head)
            }
        }
        .map_err(|e| SlotActionError::Save {
            slot,
            why: e.to_string(),
        })?;
        let n_tokens = saved.tokens.len();
        let bytes = self
            .encode_state(&saved)
            .map_err(|e| SlotActionError::Save {
                slot,
                why: e.to_string(),
            })?;
        Ok(SlotActionDone::Saved { bytes, n_tokens })
    }

    /// A state as a slot file of this model and these KV types.
    pub(super) fn encode_state(&mut self, saved: &SavedState) -> Result<Vec<u8>, ModelError> {
        let (k_type, v_type) = (self.cfg.k_type, self.cfg.v_type);
        self.with_target(|t| saved.encode(t.identity, k_type, v_type, t.vision))
    }

    /// Read a slot file written for this model and these KV types.
    pub(super) fn decode_state(&mut self, bytes: &[u8]) -> Result<SavedState, SlotFileError> {
        self.with_target(|t| SavedState::decode(bytes, t))
    }

    /// A sequence at `saved`'s position, every layer checked against the model.
    pub(super) fn resume_state(
        &mut self,
        saved: &SavedState,
    ) -> Result<SequenceState, SlotFileError> {
        self.with_target(|t| saved.resume(t))
    }

    /// Put a saved state in the prefix cache, so that any slot can resume from it.
    pub(super) fn offer_to_prefix_cache(&mut self, saved: &SavedState) {
        let Some(tree) = self.prefix.as_mut() else {
            return;
        };
        // A head state the device has no room to copy is not cached.
        let Ok(head) = saved.head.as_ref().map(HeadState::try_clone).transpose() else {
            return;
        };
        let kept: Result<(), std::convert::Infallible> = tree.insert(
            &saved.tokens,
            |start, end| Ok(saved.rows.iter().map(|r| r.range(start, end)).collect()),
            Snapshot {
                recurrent: saved.recurrent.clone(),
                head,
                images: saved.images.clone(),
            },
        );
        let Ok(()) = kept;
        self.publish_cache_gauges();
    }

    /// The deepest state the prefix cache holds on `tokens`' path at or before `max_pos`.
    pub(super) fn export_prefix(&mut self, tokens: &[u32], max_pos: usize) -> Option<SavedState> {
        let needs_head = self.spec.is_some() && self.engine.head.is_some();
        let tree = self.prefix.as_mut()?;
        let hit = tree.lookup(tokens, max_pos, |s| !needs_head || s.head.is_some())?;
        let mut rows: Vec<nextn_model::KvRows> = Vec::new();
        for segment in &hit.segments {
            if rows.is_empty() {
                rows = segment.to_vec();
                continue;
            }
            for (acc, part) in rows.iter_mut().zip(segment.iter()) {
                acc.append(part).ok()?;
            }
        }
        Some(SavedState {
            tokens: tokens[..hit.n_past].to_vec(),
            rows,
            recurrent: hit.snapshot.recurrent.clone(),
            head: hit
                .snapshot
                .head
                .as_ref()
                .map(HeadState::try_clone)
                .transpose()
                .ok()?,
            images: hit.snapshot.images.clone(),
        })
    }
}
