//! Server counters with llama-server's meanings (`tools/server/server-task.cpp` metrics), kept by
//! the inference thread and read by `/metrics`.

/// Running totals and current gauges (a copy of them, when read through the handle).
#[derive(Clone, Debug, Default)]
pub struct MetricsSnapshot {
    /// Prompt tokens run through the model.
    pub prompt_tokens_total: u64,
    /// Prompt tokens resumed from the prefix cache instead.
    pub prompt_tokens_cached_total: u64,
    /// The prefix cache: bytes held, snapshots held, snapshots stored so far, entries evicted.
    pub cache_bytes: u64,
    pub cache_snapshots: u64,
    pub cache_snapshots_stored_total: u64,
    pub cache_evictions_total: u64,
    pub prompt_seconds_total: f64,
    pub tokens_predicted_total: u64,
    pub tokens_predicted_seconds_total: f64,
    /// Target forward passes.
    pub n_decode_total: u64,
    /// Sum over target passes of the slots in them (for `n_busy_slots_per_decode`).
    pub n_busy_slots_total: u64,
    /// Largest context position reached by any slot.
    pub n_tokens_max: u64,
    pub requests_processing: usize,
    pub requests_deferred: usize,
    pub requests_finished_total: u64,
    pub requests_cancelled_total: u64,
    /// Verification steps that carried drafts.
    pub spec_drafts_total: u64,
    pub spec_draft_tokens_total: u64,
    pub spec_accepted_tokens_total: u64,
    pub spec_accepted_per_pos_total: Vec<u64>,
    /// Slots that drafted in the last step, and the draft tokens of that step.
    pub last_step_drafting_slots: usize,
    pub last_step_draft_tokens: usize,
    /// Most recent measured target pass (rows, ms).
    pub last_step_rows: usize,
    pub last_step_ms: f64,
    /// What `auto` currently believes: target and head pass milliseconds at some row counts
    /// (rows, ms), and the server-wide acceptance estimate per draft position.
    pub cost_target_ms: Vec<(usize, f64)>,
    pub cost_head_ms: Vec<(usize, f64)>,
    pub acceptance_estimate: Vec<f64>,
    /// Images the encoder thread encoded, the seconds it took, and the encodes it skipped or
    /// stopped because their request went away.
    pub images_encoded_total: u64,
    pub image_encode_seconds_total: f64,
    pub image_encodes_cancelled_total: u64,
    /// Every slot, busy or free (`/slots`).
    pub slots: Vec<super::SlotStatus>,
}

impl MetricsSnapshot {
    /// Prompt tokens per second over all processed prompts.
    pub fn prompt_tokens_per_second(&self) -> f64 {
        per_second(self.prompt_tokens_total, self.prompt_seconds_total)
    }

    /// Generated tokens per second of generation time, averaged over requests.
    pub fn predicted_tokens_per_second(&self) -> f64 {
        per_second(
            self.tokens_predicted_total,
            self.tokens_predicted_seconds_total,
        )
    }

    pub fn busy_slots_per_decode(&self) -> f64 {
        if self.n_decode_total > 0 {
            self.n_busy_slots_total as f64 / self.n_decode_total as f64
        } else {
            0.0
        }
    }
}

fn per_second(n: u64, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}
