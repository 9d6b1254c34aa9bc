//! Slot reuse: what a slot keeps between requests, and which free slot a new request takes.
//!
//! A finished request leaves its committed state in its slot ([`Kept`]) until another request
//! takes the slot. The state was that size while the request ran, so keeping it costs no memory
//! beyond the busiest moment, and it is never evicted: the next turn of the same conversation
//! continues from it without a copy, and a slot action can write it to a file
//! ([`super::slot_actions`]). The prefix cache holds its own copy (shared by every slot, bounded
//! by `--cache-ram`).

use nextn_model::SequenceState;

use super::core::Core;
use super::slot::Slot;
use super::{lock, EventSink};
use crate::speculative::draft::HeadState;

/// A free slot's state from its last request.
pub struct Kept {
    /// The committed tokens the state holds.
    pub tokens: Vec<u32>,
    pub state: SequenceState,
    /// The head's state at the same position (`None` when there is none or it could not be
    /// brought there).
    pub head: Option<HeadState>,
    /// When the slot was freed (a tick of [`Core::clock`]).
    pub freed_at: u64,
}

/// One slot as `/slots` shows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SlotStatus {
    pub id: usize,
    pub n_ctx: usize,
    pub is_processing: bool,
    /// Tokens of context the slot holds (its running request's, or those kept from its last).
    pub n_past: usize,
    /// The running or last request: prompt tokens, those resumed from a cache, tokens generated.
    pub n_prompt_tokens: usize,
    pub n_prompt_tokens_cache: usize,
    pub n_decoded: usize,
}

impl<'e> Core<'e> {
    /// Keep a finished or abandoned request's committed state (`tokens`) in its slot; the
    /// request's sink is handed back.
    pub(super) fn keep_in_slot(
        &mut self,
        index: usize,
        slot: Slot<'e>,
        tokens: Vec<u32>,
    ) -> Box<dyn EventSink> {
        self.last_request[index] = (slot.prompt.len(), slot.cache_n, slot.n_sampled as usize);
        self.clock += 1;
        let Slot {
            state, spec, sink, ..
        } = slot;
        if state.pending_rows > 0 {
            self.kept[index] = None;
            return sink;
        }
        let n_past = state.n_past;
        let head = spec.into_head_at(n_past);
        self.kept[index] = Some(Kept {
            tokens,
            state,
            head,
            freed_at: self.clock,
        });
        sink
    }

    /// The free slot for `prompt`: the one whose kept state is the longest usable prefix of it
    /// (when `reuse`), else an empty one, else the one freed longest ago. Returns the slot and
    /// how many prompt tokens its kept state covers (0 when it is not usable).
    pub(super) fn pick_slot(&self, prompt: &[u32], reuse: bool) -> Option<(usize, usize)> {
        let needs_head = self.spec.is_some() && self.engine.head.is_some();
        let usable = |k: &Kept| {
            k.tokens.len() < prompt.len()
                && prompt.starts_with(&k.tokens)
                && (!needs_head || k.head.is_some())
        };
        let free = (0..self.slots.len()).filter(|&i| self.slots[i].is_none());
        if reuse {
            let best = free
                .clone()
                .filter_map(|i| {
                    let k = self.kept[i].as_ref()?;
                    usable(k).then_some((i, k.tokens.len()))
                })
                .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)));
            if let Some((i, n)) = best.filter(|&(_, n)| n > 0) {
                return Some((i, n));
            }
        }
        free.min_by_key(|&i| self.kept[i].as_ref().map_or(0, |k| k.freed_at))
            .map(|i| (i, 0))
    }

    /// `/slots`: what every slot holds, busy or free.
    pub(super) fn publish_slots(&self) {
        let statuses = (0..self.slots.len())
            .map(|i| match &self.slots[i] {
                Some(s) => SlotStatus {
                    id: i,
                    n_ctx: self.cfg.n_ctx_slot,
                    is_processing: true,
                    n_past: s.state.n_past,
                    n_prompt_tokens: s.prompt.len(),
                    n_prompt_tokens_cache: s.cache_n,
                    n_decoded: s.out.tokens().len(),
                },
                None => {
                    let (n_prompt_tokens, n_prompt_tokens_cache, n_decoded) = self.last_request[i];
                    SlotStatus {
                        id: i,
                        n_ctx: self.cfg.n_ctx_slot,
                        is_processing: false,
                        n_past: self.kept[i].as_ref().map_or(0, |k| k.tokens.len()),
                        n_prompt_tokens,
                        n_prompt_tokens_cache,
                        n_decoded,
                    }
                }
            })
            .collect();
        lock(&self.shared.metrics).slots = statuses;
    }
}
