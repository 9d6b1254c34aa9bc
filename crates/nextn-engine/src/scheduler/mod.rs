//! The one generation loop: continuous batching of one or many requests, with MTP speculative
//! decoding per slot. `nextn run` and `nextn bench` drive it on their own thread through
//! [`Scheduler`]; `nextn serve` runs it on an inference thread of its own ([`spawn`]).
//!
//! Each step admits waiting requests into free slots,
//! decides per slot how many tokens to draft ([`policy`]), runs the NextN head for every drafting
//! slot (one batched pass per draft depth), then ONE target [`Model::forward_batch`] over the rows
//! of every busy slot — prompt chunks, single decode rows and `[id_last, drafts…]` verify rows —
//! and finally samples, accepts, commits and streams text per slot. Each slot has its own KV,
//! recurrent state, head cache and sampler, and a row's result does not depend on the rest of the
//! batch, so a request's tokens at temperature 0 are the same alone or beside others.
//!
//! Requests come in through a bounded queue ([`SchedulerHandle::submit`]); results go back
//! through the request's [`EventSink`]. A sink that reports itself closed (the client went away)
//! frees its slot at the next step.

mod calibrate;
mod core;
pub mod cost;
mod encoder;
mod metrics;
pub mod policy;
mod slot;
mod slot_actions;
mod slot_reuse;
mod step;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nextn_model::{KvType, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;

use nextn_vision::VisionTower;

use crate::grammar::Constraint;
use crate::media::PromptImage;
use crate::output::{FinishReason, GrammarEnd, Timings};
use crate::sampler::{SamplerConfig, TokenLogprob};
use crate::speculative::forced::ForcedAcceptance;
pub use crate::speculative::{DraftSampling, SpecConfig, SpecStats, StepTrace};
use crate::tokenizer::Tokenizer;

pub use metrics::MetricsSnapshot;
pub use policy::DraftPolicy;
pub use slot_actions::{SlotAction, SlotActionDone, SlotActionError};
pub use slot_reuse::SlotStatus;

/// What the inference thread owns, built by the loader once the model is read.
pub struct Engine {
    pub model: Model,
    /// The NextN head; `None` runs plain decoding.
    pub head: Option<NextnHead>,
    pub tokenizer: Arc<Tokenizer>,
    pub pool: ThreadPool,
    /// The vision tower (`--mmproj`); `None` refuses prompts with images.
    pub vision: Option<Arc<VisionTower>>,
}

impl Engine {
    pub fn parts(&self) -> EngineRef<'_> {
        EngineRef {
            model: &self.model,
            head: self.head.as_ref(),
            tokenizer: &self.tokenizer,
            pool: &self.pool,
            vision: self.vision.as_ref(),
        }
    }
}

/// What the generation loop runs on, borrowed.
#[derive(Clone, Copy)]
pub struct EngineRef<'e> {
    pub model: &'e Model,
    /// The NextN head; `None` runs plain decoding.
    pub head: Option<&'e NextnHead>,
    pub tokenizer: &'e Tokenizer,
    pub pool: &'e ThreadPool,
    /// The vision tower; shared with the thread that encodes images (`scheduler/encoder.rs`).
    pub vision: Option<&'e Arc<VisionTower>>,
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Parallel sequences (`-np`).
    pub n_slots: usize,
    /// Context length of each slot.
    pub n_ctx_slot: usize,
    pub k_type: KvType,
    pub v_type: KvType,
    /// Most prompt rows per step over all slots, so a long prompt does not stall decoding.
    pub n_batch: usize,
    /// Requests that may wait for a free slot; more are refused.
    pub queue_capacity: usize,
    /// Speculative decoding; `None` (or an engine without a head) decodes plainly.
    pub spec: Option<SpecConfig>,
    /// Which slots draft how deep in each step.
    pub policy: DraftPolicy,
    /// Measure the step-cost curves before serving (only used by [`DraftPolicy::Auto`]).
    pub calibrate: bool,
    /// Keep prompt prefixes for later requests; `None` prefills every request from its start.
    pub prefix_cache: Option<PrefixCacheConfig>,
}

/// The prefix cache shared by all slots (`--cache-ram`).
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixCacheConfig {
    /// Most bytes the cache holds (attention rows and snapshots); slots' own state is extra.
    pub budget_bytes: usize,
    /// During a long prefill, keep a snapshot every this many prompt tokens (0: never).
    pub snapshot_every: usize,
}

/// One generation request: prompt tokens and how to sample and stop.
pub struct Request {
    /// Token ids; an image's rows hold its placeholder ids ([`crate::media`]).
    pub prompt: Vec<u32>,
    /// The prompt's images in order, each at its rows of `prompt`.
    pub images: Vec<PromptImage>,
    pub sampler: SamplerConfig,
    /// Most tokens to generate; `None` runs to an end-of-generation token or a full context.
    pub n_predict: Option<usize>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Record every speculative step in [`Completion::spec`]'s trace.
    pub trace: bool,
    /// Constrained decoding: the output stays inside this grammar, and so do the drafts.
    pub grammar: Option<Constraint>,
    /// Resume from and add to the prefix cache (`cache_prompt`).
    pub cache_prompt: bool,
    /// Prompt positions worth a snapshot (where a later request is likely to diverge, such as
    /// the start of the final assistant header of a chat prompt).
    pub cache_points: Vec<usize>,
    /// Send each output token's log probability and those of its `n` most likely alternatives
    /// ([`Event::Logprobs`]).
    pub logprobs: Option<usize>,
    /// Run the speculative loop at a chosen acceptance (measurement only; see
    /// [`crate::speculative::forced`]). Needs coupled drafts and no grammar.
    pub forced_acceptance: Option<ForcedAcceptance>,
    /// Report how far the prompt has been processed ([`Event::PromptProgress`]): when the
    /// request starts and after each prompt chunk.
    pub prompt_progress: bool,
    pub sink: Box<dyn EventSink>,
}

/// Where a request's results go. `send` returns false once nobody listens any more.
pub trait EventSink: Send {
    fn send(&mut self, event: Event) -> bool;
    /// The listener is gone: the slot can be freed without waiting for the next `send`.
    fn is_closed(&self) -> bool;
}

// `Done` is the large variant and is sent once per request; the others move a few hundred
// bytes per event through a channel, which costs nothing next to a forward pass.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The request got a slot and its prompt is being processed.
    Started {
        slot: usize,
    },
    /// How far the prompt has been processed (llama-server's `prompt_progress`): `processed`
    /// of `total` prompt tokens are in the slot's state, `cache` of them resumed from a cache,
    /// `time_ms` since the request started.
    PromptProgress {
        total: usize,
        cache: usize,
        processed: usize,
        time_ms: f64,
    },
    /// Newly complete text (whole UTF-8, never part of a stop string).
    Text(String),
    /// The log probabilities of output tokens, sent before the text they complete (only when
    /// the request asked for them). Its text may come in a later [`Event::Text`] when it is held
    /// back (a possible stop string, an unfinished character).
    Logprobs(Vec<TokenLogprob>),
    Done(Completion),
    Failed {
        kind: FailKind,
        message: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailKind {
    /// The request cannot be served as given (prompt empty or too long, bad token id).
    Invalid,
    /// Cancelled by shutdown.
    Shutdown,
    /// A fault in the engine.
    Internal,
}

impl FailKind {
    /// The HTTP status a server answers with.
    pub fn status(self) -> u16 {
        match self {
            FailKind::Invalid => 400,
            FailKind::Shutdown => 503,
            FailKind::Internal => 500,
        }
    }
}

/// The end of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub finish: FinishReason,
    pub slot: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// The generated tokens (an end-of-generation token that ended the output is not included).
    pub tokens: Vec<u32>,
    pub timings: Timings,
    /// What drafting did for this request (`draft_n`, `draft_n_accepted`, per position, times).
    pub spec: SpecStats,
    /// How the request's grammar ended the output, when it did (with [`FinishReason::Stop`]).
    pub grammar_end: Option<GrammarEnd>,
    /// With a grammar: milliseconds spent computing its masks, and how many it computed.
    pub grammar_masks: Option<(f64, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the model is still loading")]
    Loading,
    #[error("the wait queue is full ({0} requests waiting)")]
    QueueFull(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("the inference engine has stopped: {0}")]
    Stopped(String),
}

/// Facts about the loaded engine, for request validation and `/v1/models`.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub n_slots: usize,
    pub n_ctx_slot: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub speculative: bool,
    /// Most drafts per slot per step (0 without speculative decoding).
    pub n_draft_max: usize,
    /// What the start-up cost measurement found (adaptive drafting only).
    pub calibration: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Loading = 0,
    Ready = 1,
    Failed = 2,
    Stopped = 3,
}

struct Inbox {
    queue: VecDeque<Request>,
    /// Slot actions waiting for their slot to be free.
    controls: Vec<slot_actions::SlotControl>,
    /// Images the encoder thread has finished, for their requests to pick up.
    encoded: Vec<encoder::Encoded>,
    shutdown: Option<Instant>,
}

struct Shared {
    phase: AtomicU8,
    inbox: Mutex<Inbox>,
    wake: Condvar,
    queue_capacity: Mutex<usize>,
    info: Mutex<Option<EngineInfo>>,
    failure: Mutex<Option<String>>,
    metrics: Mutex<MetricsSnapshot>,
}

impl Shared {
    fn new(phase: Phase, queue_capacity: usize) -> Arc<Shared> {
        Arc::new(Shared {
            phase: AtomicU8::new(phase as u8),
            inbox: Mutex::new(Inbox {
                queue: VecDeque::new(),
                controls: Vec::new(),
                encoded: Vec::new(),
                shutdown: None,
            }),
            wake: Condvar::new(),
            queue_capacity: Mutex::new(queue_capacity),
            info: Mutex::new(None),
            failure: Mutex::new(None),
            metrics: Mutex::new(MetricsSnapshot::default()),
        })
    }
}

/// Poison only means another thread panicked while holding the lock; the data is still usable
/// for counters and queues, and refusing service over it would turn one fault into an outage.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The requests side of the scheduler; cheap to clone.
#[derive(Clone)]
pub struct SchedulerHandle {
    shared: Arc<Shared>,
}

impl SchedulerHandle {
    pub fn phase(&self) -> Phase {
        match self.shared.phase.load(Ordering::Acquire) {
            0 => Phase::Loading,
            1 => Phase::Ready,
            2 => Phase::Failed,
            _ => Phase::Stopped,
        }
    }

    pub fn info(&self) -> Option<EngineInfo> {
        lock(&self.shared.info).clone()
    }

    /// Why loading failed or the engine stopped, if it did.
    pub fn failure(&self) -> Option<String> {
        lock(&self.shared.failure).clone()
    }

    /// Queue a request; it starts when a slot is free.
    pub fn submit(&self, request: Request) -> Result<(), SubmitError> {
        match self.phase() {
            Phase::Loading => return Err(SubmitError::Loading),
            Phase::Failed | Phase::Stopped => {
                return Err(SubmitError::Stopped(
                    self.failure().unwrap_or_else(|| "stopped".into()),
                ))
            }
            Phase::Ready => {}
        }
        let capacity = *lock(&self.shared.queue_capacity);
        let mut inbox = lock(&self.shared.inbox);
        if inbox.shutdown.is_some() {
            return Err(SubmitError::ShuttingDown);
        }
        if inbox.queue.len() >= capacity {
            return Err(SubmitError::QueueFull(inbox.queue.len()));
        }
        inbox.queue.push_back(request);
        lock(&self.shared.metrics).requests_deferred = inbox.queue.len();
        drop(inbox);
        self.shared.wake.notify_all();
        Ok(())
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        lock(&self.shared.metrics).clone()
    }

    /// Ask slot `slot` to save, restore or erase its kept state. The action runs on the
    /// inference thread as soon as the slot is free; the answer comes through the receiver.
    pub fn slot_action(
        &self,
        slot: usize,
        action: SlotAction,
    ) -> Result<std::sync::mpsc::Receiver<Result<SlotActionDone, SlotActionError>>, SubmitError>
    {
        match self.phase() {
            Phase::Loading => return Err(SubmitError::Loading),
            Phase::Failed | Phase::Stopped => {
                return Err(SubmitError::Stopped(
                    self.failure().unwrap_or_else(|| "stopped".into()),
                ))
            }
            Phase::Ready => {}
        }
        let (reply, answer) = std::sync::mpsc::channel();
        let mut inbox = lock(&self.shared.inbox);
        if inbox.shutdown.is_some() {
            return Err(SubmitError::ShuttingDown);
        }
        inbox.controls.push(slot_actions::SlotControl {
            slot,
            action,
            reply,
        });
        drop(inbox);
        self.shared.wake.notify_all();
        Ok(answer)
    }

    /// Stop taking requests: waiting ones are refused, running ones may finish for `grace`,
    /// then they are cancelled and the inference thread ends.
    pub fn shutdown(&self, grace: Duration) {
        let mut inbox = lock(&self.shared.inbox);
        if inbox.shutdown.is_none() {
            inbox.shutdown = Some(Instant::now() + grace);
        }
        drop(inbox);
        self.shared.wake.notify_all();
    }
}

/// The generation loop driven on the caller's thread (`nextn run`, `nextn bench`): submit
/// requests, then [`Scheduler::run`] steps until all of them have finished. Results go to each
/// request's sink as they do in the server.
pub struct Scheduler<'e> {
    core: core::Core<'e>,
    waiting: VecDeque<Request>,
    info: EngineInfo,
}

impl<'e> Scheduler<'e> {
    /// Measures the step costs first when the policy is `auto` and `cfg.calibrate` is set.
    pub fn new(engine: EngineRef<'e>, cfg: SchedulerConfig) -> Self {
        let shared = Shared::new(Phase::Ready, cfg.queue_capacity);
        let mut core = core::Core::new(engine, cfg, shared);
        let info = core.start();
        Scheduler {
            core,
            waiting: VecDeque::new(),
            info,
        }
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Queue a request; it starts when a slot is free.
    pub fn submit(&mut self, request: Request) {
        self.waiting.push_back(request);
    }

    /// Step until every submitted request has finished (or failed).
    pub fn run(&mut self) {
        loop {
            while self.core.busy() < self.core.cfg.n_slots {
                let Some(r) = self.waiting.pop_front() else {
                    break;
                };
                self.core.admit(r);
            }
            if self.core.busy() == 0 && self.waiting.is_empty() {
                return;
            }
            self.core.tick();
        }
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        lock(&self.core.shared.metrics).clone()
    }

    /// Offer a slot file's state (written by [`Scheduler::save_prefix`] or a server's slot save)
    /// to the prefix cache, so that a prompt continuing its tokens resumes from it. Returns how
    /// the tokens it holds. Needs the prefix cache ([`SchedulerConfig::prefix_cache`]).
    pub fn load_prefix(
        &mut self,
        bytes: &[u8],
    ) -> Result<Vec<u32>, crate::slot_file::SlotFileError> {
        let saved = self.core.decode_state(bytes)?;
        // Resuming checks every layer against the model before the state is offered.
        self.core.resume_state(&saved)?;
        self.core.offer_to_prefix_cache(&saved);
        Ok(saved.tokens)
    }

    /// The deepest state the prefix cache holds along `tokens`, ending at or before `max_pos`,
    /// as a slot file: its bytes and the tokens it holds.
    pub fn save_prefix(&mut self, tokens: &[u32], max_pos: usize) -> Option<(Vec<u8>, Vec<u32>)> {
        let saved = self.core.export_prefix(tokens, max_pos)?;
        let bytes = self.core.encode_state(&saved).ok()?;
        Some((bytes, saved.tokens))
    }
}

/// Start the inference thread. `load` runs on it (the model is read while the caller already
/// serves `/health` with "loading"); then the thread serves requests until [`SchedulerHandle::shutdown`].
pub fn spawn<L>(load: L) -> std::io::Result<(SchedulerHandle, JoinHandle<()>)>
where
    L: FnOnce() -> Result<(Engine, SchedulerConfig), String> + Send + 'static,
{
    let shared = Shared::new(Phase::Loading, 0);
    let handle = SchedulerHandle {
        shared: shared.clone(),
    };
    let thread = std::thread::Builder::new()
        .name("nextn-inference".into())
        .spawn(move || core::run(shared, load))?;
    Ok((handle, thread))
}
