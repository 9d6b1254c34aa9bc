//! The inference thread: admission, one batched step at a time, completion and cancellation.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nextn_model::ImageSpan;

use super::cost::{CostModel, RowCost};
use super::encoder::{encoder_threads, ImageEncoder};
use super::policy::Planner;
use super::slot::{Encoding, Slot, Stage};
use super::slot_actions::SlotActionError;
use super::slot_reuse::Kept;
use super::{
    lock, Completion, DraftSampling, Engine, EngineInfo, EngineRef, Event, FailKind, Phase,
    Request, SchedulerConfig, Shared, SpecConfig,
};
use nextn_model::{ModelError, SequenceState};

use crate::grammar::Constraint;
use crate::media::is_image_token;
use crate::output::{ms_since, FinishReason, GrammarEnd, Timings};
use crate::prefix_cache::{PrefixTree, Snapshot};
use crate::sampler::Sampler;
use crate::slot_file::ModelIdentity;
use crate::speculative::draft::HeadState;
use crate::speculative::speculator::Speculator;

/// How long the loop sleeps at most while every busy slot waits for the encoder: how soon a
/// client that went away meanwhile is noticed and its encode cancelled.
const ENCODER_POLL: Duration = Duration::from_millis(50);

pub(super) fn run<L>(shared: Arc<Shared>, load: L)
where
    L: FnOnce() -> Result<(Engine, SchedulerConfig), String>,
{
    let loaded = catch_unwind(AssertUnwindSafe(load))
        .unwrap_or_else(|_| Err("the model loader panicked".into()));
    let (engine, cfg): (Engine, SchedulerConfig) = match loaded {
        Ok(x) => x,
        Err(e) => {
            *lock(&shared.failure) = Some(e);
            shared.phase.store(Phase::Failed as u8, Ordering::Release);
            return;
        }
    };
    let mut core = Core::new(engine.parts(), cfg, shared.clone());
    let info = core.start();
    *lock(&shared.queue_capacity) = core.cfg.queue_capacity;
    *lock(&shared.info) = Some(info);
    shared.phase.store(Phase::Ready as u8, Ordering::Release);
    core.serve();
    shared.phase.store(Phase::Stopped as u8, Ordering::Release);
}

pub(super) struct Core<'e> {
    pub engine: EngineRef<'e>,
    pub cfg: SchedulerConfig,
    pub shared: Arc<Shared>,
    pub slots: Vec<Option<Slot<'e>>>,
    /// Speculative settings when the engine can draft.
    pub spec: Option<SpecConfig>,
    pub cost: CostModel,
    pub planner: Planner,
    next_seq: u64,
    /// Prompt prefixes kept for later requests.
    pub prefix: Option<PrefixTree<Snapshot>>,
    /// Each free slot's state from its last request.
    pub kept: Vec<Option<Kept>>,
    /// Each slot's last request: prompt tokens, those from a cache, tokens generated.
    pub last_request: Vec<(usize, usize, usize)>,
    /// Ticks once per freed slot, for picking the slot freed longest ago.
    pub clock: u64,
    /// The model's identity for slot files, computed when first needed.
    pub identity: Option<ModelIdentity>,
    /// The thread that encodes images, started by the first request with an image to encode.
    encoder: Option<ImageEncoder>,
}

impl<'e> Core<'e> {
    pub fn new(engine: EngineRef<'e>, mut cfg: SchedulerConfig, shared: Arc<Shared>) -> Self {
        cfg.n_slots = cfg.n_slots.max(1);
        cfg.n_batch = cfg.n_batch.max(1);
        let spec = cfg
            .spec
            .clone()
            .filter(|s| s.n_max > 0 && engine.head.is_some());
        let n_slots = cfg.n_slots;
        let planner = Planner::new(
            cfg.policy,
            spec.as_ref().map(|s| (s.n_max, s.n_min)),
            cfg.n_batch,
        );
        let prefix = cfg
            .prefix_cache
            .as_ref()
            .map(|c| PrefixTree::new(c.budget_bytes));
        // Until measured: a pass costs a fixed part plus a little per row (weights dominate).
        let rough = RowCost::from_points(&[(1, 10.0), (64, 20.0)], 0.05);
        Core {
            engine,
            slots: (0..cfg.n_slots).map(|_| None).collect(),
            cfg,
            shared,
            spec,
            cost: CostModel {
                target: rough.clone(),
                head: RowCost::from_points(&[(1, 1.5), (64, 3.0)], 0.05),
                per_slot_ms: 0.05,
                commit_ms: 0.2,
            },
            planner,
            next_seq: 0,
            prefix,
            kept: (0..n_slots).map(|_| None).collect(),
            last_request: vec![(0, 0, 0); n_slots],
            clock: 0,
            identity: None,
            encoder: None,
        }
    }

    pub fn busy(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Measure the step costs when the policy needs them; what the engine offers.
    pub fn start(&mut self) -> EngineInfo {
        let calibration = self.wants_calibration().then(|| self.calibrate());
        self.publish_slots();
        EngineInfo {
            n_slots: self.cfg.n_slots,
            n_ctx_slot: self.cfg.n_ctx_slot,
            n_vocab: self.engine.model.n_vocab,
            n_ctx_train: self.engine.model.config.n_ctx_train,
            speculative: self.spec.is_some(),
            n_draft_max: self.spec.as_ref().map_or(0, |s| s.n_max),
            calibration,
        }
    }

    /// Free the slots of clients that went away, run one step over the busy slots (a failed step
    /// cancels them all) and publish the gauges.
    pub fn tick(&mut self) {
        self.collect_encoded();
        self.reap_closed();
        if self.busy() == 0 {
            return;
        }
        if self.slots.iter().flatten().all(Slot::waits_for_image) {
            // Nothing to step until an image is encoded (or a request comes in).
            self.wait_for_encoder();
            return;
        }
        let result = catch_unwind(AssertUnwindSafe(|| self.step()));
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.cancel_all(FailKind::Internal, &format!("inference failed: {e}")),
            Err(_) => self.cancel_all(
                FailKind::Internal,
                "inference failed: internal error (panic in a forward pass)",
            ),
        }
        self.publish_gauges();
    }

    /// Serve until shutdown: admit, step, repeat; sleep while idle.
    pub fn serve(&mut self) {
        loop {
            let shared = self.shared.clone();
            let deadline = {
                let mut inbox = lock(&shared.inbox);
                loop {
                    if inbox.shutdown.is_some() {
                        for r in inbox.queue.drain(..) {
                            let mut sink = r.sink;
                            sink.send(Event::Failed {
                                kind: FailKind::Shutdown,
                                message: "the server is shutting down".into(),
                            });
                        }
                        for c in inbox.controls.drain(..) {
                            let _ = c.reply.send(Err(SlotActionError::ShuttingDown));
                        }
                    }
                    // Slot actions go first: a slot they wait for is not given to a request.
                    let controls = std::mem::take(&mut inbox.controls);
                    for c in controls {
                        if self.slots.get(c.slot).is_some_and(Option::is_some) {
                            inbox.controls.push(c);
                        } else {
                            let _ = c.reply.send(self.run_slot_action(c.slot, c.action));
                        }
                    }
                    if self.busy() > 0 || !inbox.queue.is_empty() {
                        break;
                    }
                    if inbox.shutdown.is_some() {
                        lock(&self.shared.metrics).requests_deferred = 0;
                        return;
                    }
                    inbox = shared
                        .wake
                        .wait_timeout(inbox, Duration::from_millis(500))
                        .map(|r| r.0)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                while self.busy() < self.cfg.n_slots {
                    let Some(r) = inbox.queue.pop_front() else {
                        break;
                    };
                    if r.sink.is_closed() {
                        lock(&self.shared.metrics).requests_cancelled_total += 1;
                        continue;
                    }
                    self.admit(r);
                }
                lock(&self.shared.metrics).requests_deferred = inbox.queue.len();
                inbox.shutdown
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                self.cancel_all(FailKind::Shutdown, "cancelled: the server is shutting down");
            }
            self.tick();
        }
    }

    pub(super) fn admit(&mut self, request: Request) {
        let Some((index, kept_n)) = self.pick_slot(&request.prompt, request.cache_prompt) else {
            return;
        };
        let fail = |mut r: Request, message: String| {
            r.sink.send(Event::Failed {
                kind: FailKind::Invalid,
                message,
            });
        };
        let n_ctx = self.cfg.n_ctx_slot;
        if request.prompt.is_empty() {
            return fail(
                request,
                "the prompt is empty: at least one token is needed".into(),
            );
        }
        if let Err(message) = self.check_images(&request) {
            return fail(request, message);
        }
        if request.prompt.len() >= n_ctx {
            let n = request.prompt.len();
            let image_rows: usize = request.images.iter().map(|im| im.n_tokens()).sum();
            let of_images = match request.images.len() {
                0 => String::new(),
                k => format!(" ({image_rows} of them for {k} image(s))"),
            };
            return fail(request, format!("the prompt has {n} tokens{of_images}, but the context holds {n_ctx} (at least one more is needed to generate)"));
        }
        let n_vocab = self.engine.model.n_vocab;
        if let Some(&bad) = request
            .prompt
            .iter()
            .find(|&&t| t as usize >= n_vocab && !is_image_token(t))
        {
            return fail(
                request,
                format!("token id {bad} is out of range: the vocabulary has {n_vocab} tokens"),
            );
        }
        let mut sampler = match Sampler::new(request.sampler.clone()) {
            Ok(s) => s,
            Err(e) => return fail(request, e.to_string()),
        };
        if request.forced_acceptance.is_some() {
            let sampled_drafts = self.spec.as_ref().is_some_and(|s| {
                s.draft_sampling == DraftSampling::Sample && !sampler.config().is_greedy()
            });
            if request.grammar.is_some() || sampled_drafts {
                return fail(
                    request,
                    "forced acceptance needs coupled drafts and no grammar: it rewrites the drafts towards the plain output".into(),
                );
            }
        }
        for &t in request.prompt.iter().filter(|&&t| !is_image_token(t)) {
            sampler.accept(t);
        }
        let (kt, vt) = (self.cfg.k_type, self.cfg.v_type);
        let model = self.engine.model;
        let (mut state, mut head) = match self.fresh_sequence(index) {
            Ok(s) => s,
            Err(e) => {
                let mut r = request;
                r.sink.send(Event::Failed {
                    kind: FailKind::Internal,
                    message: format!("no room for this request's caches: {e}"),
                });
                return;
            }
        };
        let mut cache_n = 0;
        let mut request = request;
        // The slot's own state from its last request, when the prompt continues it: no copy.
        let kept = self.kept[index].take().filter(|_| kept_n > 0);
        if let Some(tree) = self.prefix.as_mut().filter(|_| request.cache_prompt) {
            // The last prompt token is always run: its row gives the first output token.
            let needs_head = head.is_some();
            let max_pos = request.prompt.len() - 1;
            if let Some(hit) = tree
                .lookup(&request.prompt, max_pos, |s| {
                    !needs_head || s.head.is_some()
                })
                .filter(|hit| hit.n_past > kept_n)
            {
                // A hit the device has no room to copy is a miss.
                let hit_head = match &hit.snapshot.head {
                    Some(h) if needs_head => h.try_clone().ok().map(Some),
                    _ => Some(None),
                };
                if let (Ok(mut resumed), Some(hit_head)) =
                    (model.new_sequence(n_ctx, kt, vt), hit_head)
                {
                    if resumed
                        .restore(hit.segments.iter().copied(), &hit.snapshot.recurrent)
                        .is_ok()
                    {
                        state = resumed;
                        if needs_head {
                            head = hit_head;
                        }
                        cache_n = hit.n_past;
                    }
                }
            }
        }
        if let Some(k) = kept.filter(|_| cache_n == 0) {
            state = k.state;
            if head.is_some() {
                head = k.head;
            }
            cache_n = kept_n;
        }
        if request
            .images
            .iter()
            .any(|im| im.pos < cache_n && cache_n < im.end())
        {
            // A resumed state never ends inside an image (an image is one chunk); should one,
            // the prompt runs from its start.
            match self.fresh_sequence(index) {
                Ok((s, h)) => (state, head) = (s, h),
                Err(e) => {
                    request.sink.send(Event::Failed {
                        kind: FailKind::Internal,
                        message: format!("no room for this request's caches: {e}"),
                    });
                    return;
                }
            }
            cache_n = 0;
        }
        // The images among the resumed rows set the rotary positions of the rows after them.
        state.images = request
            .images
            .iter()
            .filter(|im| im.end() <= cache_n)
            .map(|im| ImageSpan {
                start: im.pos,
                n_tokens: im.n_tokens(),
                n_pos: im.n_pos(),
            })
            .collect();
        if let Some(every) = self
            .cfg
            .prefix_cache
            .as_ref()
            .map(|c| c.snapshot_every)
            .filter(|&e| e > 0 && request.cache_prompt)
        {
            let n = request.prompt.len();
            request
                .cache_points
                .extend((1..).map(|k| k * every).take_while(|&p| p < n));
        }
        let images = &request.images;
        request
            .cache_points
            .retain(|&p| !images.iter().any(|im| im.pos < p && p < im.end()));
        let n_max = self.spec.as_ref().map_or(0, |s| s.n_max);
        // p/q acceptance needs a distribution to draw drafts from: only when sampling.
        let draft_sampling = match &self.spec {
            Some(s)
                if s.draft_sampling == DraftSampling::Sample && !sampler.config().is_greedy() =>
            {
                DraftSampling::Sample
            }
            _ => DraftSampling::Coupled,
        };
        self.next_seq += 1;
        let forced = request.forced_acceptance.take();
        let spec = Speculator::new(head, draft_sampling, forced, n_max);
        let mut slot = Slot::new(
            request,
            sampler,
            state,
            spec,
            self.engine.tokenizer,
            n_max,
            self.next_seq,
            cache_n,
        );
        lock(&self.shared.metrics).prompt_tokens_cached_total += cache_n as u64;
        // Counted before the client hears of it: a client that reads /metrics once its request
        // has started sees it processing.
        {
            let mut m = lock(&self.shared.metrics);
            m.requests_processing = self.busy() + 1;
        }
        if let Err(message) = self.start_encodes(index, &mut slot) {
            let mut sink = slot.sink;
            sink.send(Event::Failed {
                kind: FailKind::Internal,
                message,
            });
            let busy = self.busy();
            lock(&self.shared.metrics).requests_processing = busy;
            return;
        }
        if slot.sink.send(Event::Started { slot: index }) {
            slot.report_prompt_progress(cache_n);
            self.slots[index] = Some(slot);
        } else {
            let busy = self.busy();
            let mut m = lock(&self.shared.metrics);
            m.requests_cancelled_total += 1;
            m.requests_processing = busy;
        }
    }

    /// A new sequence's caches, and its head's when drafting. Where the device has no room, the
    /// states other slots keep for a continuing prompt are given up first (this slot's own last),
    /// as llama-server reuses slots: a request is refused only when even that does not help.
    fn fresh_sequence(
        &mut self,
        index: usize,
    ) -> Result<(SequenceState, Option<HeadState>), ModelError> {
        let (kt, vt) = (self.cfg.k_type, self.cfg.v_type);
        let n_ctx = self.cfg.n_ctx_slot;
        let model = self.engine.model;
        let head = self.spec.as_ref().and(self.engine.head);
        let allocate = || -> Result<_, ModelError> {
            let state = model.new_sequence(n_ctx, kt, vt)?;
            let head = head
                .map(|h| HeadState::new(h, model.config.n_embd, kt, vt, n_ctx))
                .transpose()?;
            Ok((state, head))
        };
        let mut order: Vec<usize> = (0..self.kept.len()).filter(|&i| i != index).collect();
        order.push(index);
        let mut result = allocate();
        for i in order {
            match result {
                Err(ModelError::DeviceMemory(_)) if self.kept[i].is_some() => {
                    self.kept[i] = None;
                    result = allocate();
                }
                _ => break,
            }
        }
        result
    }

    /// Hand the images of a request admitted to slot `index` to the encoder: those its prompt
    /// still has to run (not those among the rows resumed from a cache). The encoder thread is
    /// started with the first of them.
    fn start_encodes(&mut self, index: usize, slot: &mut Slot<'e>) -> Result<(), String> {
        let n_past = match slot.stage {
            Stage::Prefill { next } => next,
            Stage::Decode { .. } => return Ok(()),
        };
        let todo: Vec<usize> = (0..slot.images.len())
            .filter(|&k| slot.images[k].pos >= n_past)
            .collect();
        if todo.is_empty() {
            return Ok(());
        }
        let tower = self
            .engine
            .vision
            .ok_or("the prompt has images, but no vision tower is loaded")?;
        if self.encoder.is_none() {
            let threads = encoder_threads(
                tower.on_device(),
                self.cfg.n_slots,
                self.engine.pool.n_threads(),
            );
            let encoder = ImageEncoder::spawn(tower.clone(), threads, self.shared.clone())
                .map_err(|e| format!("cannot start the image encoder thread: {e}"))?;
            self.encoder = Some(encoder);
        }
        let encoder = self
            .encoder
            .as_ref()
            .ok_or("the image encoder thread is not running")?;
        for &k in &todo {
            slot.encodings[k] = Encoding::Waiting;
        }
        let images = todo.iter().map(|&k| (k, slot.images[k].image.clone()));
        slot.encode_ticket = Some(encoder.submit(index, slot.seq_no, images));
        Ok(())
    }

    /// Give each finished encode to the request that waits for it (one that went away meanwhile
    /// is gone, and so is its result); a failed encode ends its request.
    fn collect_encoded(&mut self) {
        let done = std::mem::take(&mut lock(&self.shared.inbox).encoded);
        for e in done {
            let i = e.key.slot;
            let Some(slot) = self.slots.get_mut(i).and_then(Option::as_mut) else {
                continue;
            };
            if slot.seq_no != e.key.seq_no {
                continue;
            }
            match e.result {
                Ok(emb) => {
                    if let Some(enc) = slot.encodings.get_mut(e.key.image) {
                        *enc = Encoding::Ready(emb);
                        slot.images_encoded += 1;
                        slot.image_encode_ms += e.ms;
                    }
                }
                Err(message) => self.fail(i, &message),
            }
        }
    }

    /// Every busy slot waits for an image: sleep until the encoder delivers one, a request or
    /// slot action comes in (both wake the loop), or [`ENCODER_POLL`] has passed (clients that
    /// went away are noticed at the next tick).
    fn wait_for_encoder(&self) {
        let inbox = lock(&self.shared.inbox);
        let admissible = !inbox.queue.is_empty() && self.busy() < self.cfg.n_slots;
        if inbox.encoded.is_empty() && !admissible {
            let _ = self.shared.wake.wait_timeout(inbox, ENCODER_POLL);
        }
    }

    /// A request's images: the engine can encode them, each lies inside the prompt after the
    /// one before, and its rows hold its placeholder ids.
    fn check_images(&self, request: &Request) -> Result<(), String> {
        if request.images.is_empty() {
            return Ok(());
        }
        if self.engine.vision.is_none() {
            return Err(
                "the prompt has images, but no vision tower is loaded (start with --mmproj FILE)"
                    .into(),
            );
        }
        let mut after = 0;
        for (k, im) in request.images.iter().enumerate() {
            if im.pos < after || !im.matches(&request.prompt) {
                return Err(format!(
                    "image {k} does not sit at its placeholder rows {}..{} of the prompt",
                    im.pos,
                    im.end()
                ));
            }
            after = im.end();
        }
        let image_rows: usize = request.images.iter().map(|im| im.n_tokens()).sum();
        let placeholders = request
            .prompt
            .iter()
            .filter(|&&t| is_image_token(t))
            .count();
        if placeholders != image_rows {
            return Err(format!(
                "the prompt has {placeholders} image rows, but its images take {image_rows}"
            ));
        }
        Ok(())
    }

    /// Free the slots whose clients went away.
    fn reap_closed(&mut self) {
        let mut cancelled = 0;
        for i in 0..self.slots.len() {
            if self.slots[i]
                .as_ref()
                .is_some_and(|slot| slot.sink.is_closed())
            {
                if let Some(slot) = self.slots[i].take() {
                    let committed = slot.committed_tokens();
                    self.keep_in_slot(i, slot, committed);
                }
                cancelled += 1;
            }
        }
        if cancelled > 0 {
            let busy = self.busy();
            let mut m = lock(&self.shared.metrics);
            m.requests_cancelled_total += cancelled;
            m.requests_processing = busy;
        }
    }

    pub fn cancel_all(&mut self, kind: FailKind, message: &str) {
        let mut n = 0;
        for s in self.slots.iter_mut() {
            if let Some(mut slot) = s.take() {
                slot.sink.send(Event::Failed {
                    kind,
                    message: message.to_string(),
                });
                n += 1;
            }
        }
        let mut m = lock(&self.shared.metrics);
        m.requests_cancelled_total += n;
        m.requests_processing = 0;
    }

    /// Free a slot after its last token: flush held-back text, report the completion.
    pub fn finish(&mut self, index: usize, finish: FinishReason, grammar_end: Option<GrammarEnd>) {
        let Some(mut slot) = self.slots[index].take() else {
            return;
        };
        if slot.cache_prompt {
            self.keep_prefix(&slot);
        }
        let committed = slot.committed_tokens();
        let (rest, tokens) = slot.out.finish();
        let predicted_ms = slot.t_first_token.map_or(0.0, ms_since);
        let completion = Completion {
            finish,
            slot: index,
            prompt_tokens: slot.prompt.len(),
            completion_tokens: tokens.len(),
            timings: Timings {
                prompt_n: slot.prompt.len() - slot.cache_n,
                cache_n: slot.cache_n,
                prompt_ms: slot.prompt_ms,
                predicted_n: tokens.len(),
                predicted_ms,
                images_encoded: slot.images_encoded,
                image_encode_ms: slot.image_encode_ms,
            },
            tokens,
            spec: std::mem::take(&mut slot.stats),
            grammar_end,
            grammar_masks: slot.grammar.as_ref().and_then(Constraint::mask_time),
        };
        // Counters first: a client that reads /metrics right after its answer sees itself counted.
        let busy = self.busy();
        {
            let mut m = lock(&self.shared.metrics);
            m.requests_processing = busy;
            m.tokens_predicted_seconds_total += predicted_ms / 1000.0;
            m.requests_finished_total += 1;
        }
        // The slot's state is kept (and /slots says so) before the client hears the end.
        let mut sink = self.keep_in_slot(index, slot, committed);
        self.publish_slots();
        let delivered =
            (rest.is_empty() || sink.send(Event::Text(rest))) && sink.send(Event::Done(completion));
        if !delivered {
            let mut m = lock(&self.shared.metrics);
            m.requests_finished_total -= 1;
            m.requests_cancelled_total += 1;
        }
    }

    /// Keep `slot`'s committed state in the prefix cache (its attention rows where the tree
    /// lacks them, and a snapshot at its position).
    pub fn keep_prefix(&mut self, slot: &Slot<'_>) {
        let Some(tree) = self.prefix.as_mut() else {
            return;
        };
        let Ok(recurrent) = slot.state.recurrent_snapshot() else {
            return;
        };
        let n_past = slot.state.n_past;
        // The head's state goes along only when it stands exactly at the target's position.
        let head = slot.spec.head_at(n_past);
        let tokens = slot.committed_tokens();
        if tree
            .insert(
                &tokens,
                |start, end| slot.state.attention_rows(start, end),
                Snapshot {
                    recurrent,
                    head,
                    images: slot.state.images.clone(),
                },
            )
            .is_err()
        {
            // The rows could not be read back from the device: nothing is kept, and the request
            // goes on without the cache entry.
            return;
        }
        lock(&self.shared.metrics).cache_snapshots_stored_total += 1;
        self.publish_cache_gauges();
    }

    fn publish_gauges(&self) {
        let busy = self.busy();
        const ROWS: [usize; 6] = [1, 2, 4, 8, 16, 64];
        let target: Vec<(usize, f64)> = ROWS
            .iter()
            .map(|&r| (r, self.cost.target.pass_ms(r, 1)))
            .collect();
        let head: Vec<(usize, f64)> = ROWS
            .iter()
            .map(|&r| (r, self.cost.head.pass_ms(r, 1)))
            .collect();
        let acceptance = self.planner.acceptance_estimate();
        let mut m = lock(&self.shared.metrics);
        m.requests_processing = busy;
        if self.spec.is_some() {
            m.cost_target_ms = target;
            m.cost_head_ms = head;
            m.acceptance_estimate = acceptance;
        }
        for s in self.slots.iter().flatten() {
            m.n_tokens_max = m.n_tokens_max.max(s.state.n_past as u64);
        }
        drop(m);
        self.publish_slots();
    }

    pub(super) fn publish_cache_gauges(&self) {
        let Some(tree) = self.prefix.as_ref() else {
            return;
        };
        let mut m = lock(&self.shared.metrics);
        m.cache_bytes = tree.bytes() as u64;
        m.cache_snapshots = tree.snapshots() as u64;
        m.cache_evictions_total = tree.evictions();
    }
}
