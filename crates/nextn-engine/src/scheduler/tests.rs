//! The scheduler on the bundled tiny model: same tokens as one-sequence generation, independent
//! of what else runs, cancellation, the bounded queue, shutdown.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use nextn_gguf::GgufFile;
use nextn_model::{KvType, LogitRows, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;

use super::head_batch::{head_forward_batch, HeadItem};
use super::*;
use crate::generate::{generate, GenerateParams};
use crate::sampler::{Sampler, SamplerConfig};

fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny-qwen35-mtp-Q8_0.gguf")
}

fn engine(with_head: bool) -> Engine {
    let file = Arc::new(GgufFile::open(bundled()).expect("open bundled model"));
    let model = Model::load(file.clone()).expect("load model");
    let head = with_head.then(|| NextnHead::load(&model).expect("load head"));
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    Engine {
        model,
        head,
        tokenizer,
        pool: ThreadPool::new(2),
    }
}

fn config(n_slots: usize, policy: Option<DraftPolicy>) -> SchedulerConfig {
    SchedulerConfig {
        n_slots,
        n_ctx_slot: 512,
        k_type: KvType::F16,
        v_type: KvType::F16,
        n_batch: 64,
        queue_capacity: 64,
        spec: policy.map(|policy| SpecConfig {
            n_max: 3,
            n_min: 0,
            p_min: 0.0,
            draft_sampling: DraftSampling::Greedy,
            policy,
        }),
        calibrate: true,
    }
}

struct TestSink {
    tx: mpsc::Sender<Event>,
    closed: Arc<AtomicBool>,
}

impl EventSink for TestSink {
    fn send(&mut self, event: Event) -> bool {
        !self.closed.load(Ordering::Acquire) && self.tx.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

struct Pending {
    rx: mpsc::Receiver<Event>,
    closed: Arc<AtomicBool>,
}

fn request(prompt: Vec<u32>, sampler: SamplerConfig, n_predict: usize) -> (Request, Pending) {
    let (tx, rx) = mpsc::channel();
    let closed = Arc::new(AtomicBool::new(false));
    let sink = TestSink {
        tx,
        closed: closed.clone(),
    };
    let r = Request {
        prompt,
        sampler,
        n_predict: Some(n_predict),
        stop: Vec::new(),
        ignore_eos: true,
        sink: Box::new(sink),
    };
    (r, Pending { rx, closed })
}

/// Text and completion of a request, or the failure.
fn wait(p: &Pending) -> Result<(String, Completion), (FailKind, String)> {
    let mut text = String::new();
    loop {
        match p
            .rx
            .recv_timeout(Duration::from_secs(300))
            .expect("the scheduler answers")
        {
            Event::Started { .. } => {}
            Event::Text(t) => text.push_str(&t),
            Event::Done(c) => return Ok((text, c)),
            Event::Failed { kind, message } => return Err((kind, message)),
        }
    }
}

fn start(engine: Engine, cfg: SchedulerConfig) -> (SchedulerHandle, std::thread::JoinHandle<()>) {
    let (h, t) = spawn(move || Ok((engine, cfg))).expect("spawn");
    while h.phase() == Phase::Loading {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(h.phase(), Phase::Ready, "{:?}", h.failure());
    (h, t)
}

fn reference_text(prompt: &[u32], sampler: SamplerConfig, n: usize) -> String {
    let e = engine(false);
    let mut state = e.model.new_sequence(512, KvType::F16, KvType::F16);
    let params = GenerateParams {
        n_predict: Some(n),
        ignore_eos: true,
        ..Default::default()
    };
    let mut s = Sampler::new(sampler).unwrap();
    generate(
        &e.model,
        &e.tokenizer,
        &e.pool,
        &mut state,
        prompt,
        &params,
        &mut s,
        |_| true,
    )
    .unwrap()
    .text
}

const PROMPTS: [&str; 4] = [
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "# Return the factorial of n.\ndef factorial(n):\n",
    "The quick brown fox",
];

#[test]
fn head_batch_equals_one_sequence_at_a_time() {
    let mut e = engine(true);
    check_head_batch(&e);
    // With a draft vocabulary the batched head must trim its logits the same way.
    let kept: Vec<u32> = (0..8192).step_by(3).collect();
    e.head.as_mut().unwrap().restrict_vocab(&kept).unwrap();
    check_head_batch(&e);
}

fn check_head_batch(e: &Engine) {
    let head = e.head.as_ref().unwrap();
    let n_embd = e.model.config.n_embd;
    let eps = e.model.config.rms_eps;
    let seqs: Vec<(Vec<u32>, Vec<f32>)> = [3usize, 1, 5]
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let tokens: Vec<u32> = (0..n).map(|i| ((i * 31 + k * 97) % 8000) as u32).collect();
            let hidden: Vec<f32> = (0..n * n_embd)
                .map(|i| ((i * 7 + k) % 13) as f32 / 13.0 - 0.5)
                .collect();
            (tokens, hidden)
        })
        .collect();
    let mut alone = Vec::new();
    for (t, h) in &seqs {
        let mut cache = head.new_cache(KvType::F16, KvType::F16);
        head.forward(
            &t[..1],
            &h[..n_embd],
            0,
            &mut cache,
            LogitRows::Last,
            &e.pool,
        )
        .unwrap();
        alone.push(
            head.forward(
                &t[1..],
                &h[n_embd..],
                1,
                &mut cache,
                LogitRows::All,
                &e.pool,
            )
            .unwrap(),
        );
    }
    let mut caches: Vec<_> = seqs
        .iter()
        .map(|_| head.new_cache(KvType::F16, KvType::F16))
        .collect();
    for ((t, h), c) in seqs.iter().zip(caches.iter_mut()) {
        head.forward(&t[..1], &h[..n_embd], 0, c, LogitRows::Last, &e.pool)
            .unwrap();
    }
    let mut items: Vec<HeadItem> = seqs
        .iter()
        .zip(caches.iter_mut())
        .map(|((t, h), cache)| HeadItem {
            tokens: &t[1..],
            hidden_prev: &h[n_embd..],
            start_pos: 1,
            cache,
            logits: LogitRows::All,
        })
        .collect();
    let batched = head_forward_batch(head, eps, &mut items, &e.pool).unwrap();
    for (a, b) in alone.iter().zip(&batched) {
        assert_eq!(a.hidden, b.hidden);
        assert_eq!(a.logits.len(), b.logits.len());
        for (x, y) in a.logits.iter().zip(&b.logits) {
            assert_eq!(x.to_bits(), y.to_bits());
        }
    }
    let trimmed = head.draft_vocab_size() < head.n_vocab();
    let infinite = batched[0].logits.iter().filter(|v| v.is_infinite()).count();
    assert_eq!(infinite > 0, trimmed, "{infinite} −∞ logits");
}

#[test]
fn one_request_gives_what_generate_gives_in_every_mode() {
    let prompt = engine(false).tokenizer.encode(PROMPTS[0], true);
    let want = reference_text(&prompt, SamplerConfig::greedy(), 48);
    for (with_head, policy) in [
        (false, None),
        (true, Some(DraftPolicy::Auto)),
        (true, Some(DraftPolicy::MaxSlots(4))),
    ] {
        let (h, t) = start(engine(with_head), config(2, policy));
        let (r, p) = request(prompt.clone(), SamplerConfig::greedy(), 48);
        h.submit(r).unwrap();
        let (text, c) = wait(&p).unwrap();
        assert_eq!(text, want, "policy {policy:?}");
        assert_eq!(c.completion_tokens, 48);
        assert_eq!(c.prompt_tokens, prompt.len());
        if policy == Some(DraftPolicy::MaxSlots(4)) {
            assert!(c.draft_n > 0 && c.draft_n_accepted <= c.draft_n, "{c:?}");
        }
        let m = h.metrics();
        assert_eq!(m.tokens_predicted_total, 48);
        assert_eq!(m.prompt_tokens_total, prompt.len() as u64);
        assert_eq!(m.spec_draft_tokens_total, c.draft_n);
        assert_eq!(m.spec_accepted_tokens_total, c.draft_n_accepted);
        assert!(m.spec_accepted_per_pos_total.first().copied().unwrap_or(0) <= m.spec_drafts_total);
        h.shutdown(Duration::ZERO);
        t.join().unwrap();
    }
}

#[test]
fn sampled_drafts_give_what_generate_speculative_gives() {
    let e = engine(true);
    let prompt = e.tokenizer.encode(PROMPTS[3], true);
    let cfg = SamplerConfig {
        temperature: 0.8,
        seed: 77,
        ..SamplerConfig::default()
    };
    let spec = crate::speculative::SpecParams {
        n_max: 3,
        draft_sampling: DraftSampling::Sample,
        ..Default::default()
    };
    let mut seq = crate::speculative::SpecSequence::new(
        &e.model,
        e.head.as_ref().unwrap(),
        512,
        KvType::F16,
        KvType::F16,
    );
    let params = GenerateParams {
        n_predict: Some(40),
        ignore_eos: true,
        ..Default::default()
    };
    let mut s = Sampler::new(cfg.clone()).unwrap();
    let (want, stats) = crate::speculative::generate_speculative(
        &e.model,
        e.head.as_ref().unwrap(),
        &e.tokenizer,
        &e.pool,
        &mut seq,
        &prompt,
        &params,
        &spec,
        &mut s,
        |_| true,
    )
    .unwrap();
    let mut c = config(2, Some(DraftPolicy::MaxSlots(2)));
    if let Some(sc) = c.spec.as_mut() {
        sc.draft_sampling = DraftSampling::Sample;
    }
    let (h, t) = start(engine(true), c);
    let (r, p) = request(prompt, cfg, 40);
    h.submit(r).unwrap();
    let (text, done) = wait(&p).unwrap();
    assert_eq!(text, want.text);
    assert_eq!(
        (done.draft_n, done.draft_n_accepted),
        (stats.draft_n, stats.draft_n_accepted)
    );
    h.shutdown(Duration::ZERO);
    t.join().unwrap();
}

#[test]
fn output_does_not_depend_on_what_else_runs() {
    let tok = engine(false).tokenizer.clone();
    let target = tok.encode(PROMPTS[1], true);
    let seeded = SamplerConfig {
        temperature: 0.9,
        seed: 1234,
        ..SamplerConfig::default()
    };
    let alone_greedy = reference_text(&target, SamplerConfig::greedy(), 40);
    let alone_seeded = reference_text(&target, seeded.clone(), 40);
    for policy in [
        Some(DraftPolicy::Auto),
        Some(DraftPolicy::MaxSlots(16)),
        None,
    ] {
        let mut cfg = config(16, policy);
        // Small prompt chunks: prefill of some slots interleaves with decoding of others.
        cfg.n_batch = 7;
        let (h, t) = start(engine(policy.is_some()), cfg);
        let mut pending = Vec::new();
        for i in 0..16 {
            let (prompt, sampler) = match i {
                5 => (target.clone(), SamplerConfig::greedy()),
                11 => (target.clone(), seeded.clone()),
                _ => (
                    tok.encode(&format!("{}{}", PROMPTS[i % 4], "x = 1\n".repeat(i)), true),
                    SamplerConfig::greedy(),
                ),
            };
            let n = if i == 5 || i == 11 { 40 } else { 30 + i };
            let (r, p) = request(prompt, sampler, n);
            h.submit(r).unwrap();
            pending.push(p);
        }
        let results: Vec<_> = pending.iter().map(|p| wait(p).unwrap()).collect();
        assert_eq!(results[5].0, alone_greedy, "greedy, policy {policy:?}");
        assert_eq!(results[11].0, alone_seeded, "seeded, policy {policy:?}");
        for (i, (_, c)) in results.iter().enumerate() {
            assert_eq!(
                c.completion_tokens,
                if i == 5 || i == 11 { 40 } else { 30 + i }
            );
        }
        let m = h.metrics();
        let total: usize = results.iter().map(|r| r.1.completion_tokens).sum();
        assert_eq!(m.tokens_predicted_total, total as u64);
        assert_eq!(
            m.spec_draft_tokens_total,
            results.iter().map(|r| r.1.draft_n).sum::<u64>()
        );
        h.shutdown(Duration::ZERO);
        t.join().unwrap();
    }
}

#[test]
fn a_closed_sink_frees_its_slot_and_the_queue_is_bounded() {
    let mut cfg = config(1, Some(DraftPolicy::Auto));
    cfg.queue_capacity = 1;
    let (h, t) = start(engine(true), cfg);
    let tok = engine(false).tokenizer.clone();
    let prompt = tok.encode(PROMPTS[2], true);
    let (long, long_p) = request(prompt.clone(), SamplerConfig::greedy(), 400);
    h.submit(long).unwrap();
    // Wait until the long request holds the only slot and has produced text.
    loop {
        match long_p.rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Text(_) => break,
            Event::Started { slot } => assert_eq!(slot, 0),
            other => panic!("unexpected {other:?}"),
        }
    }
    let (queued, queued_p) = request(prompt.clone(), SamplerConfig::greedy(), 8);
    h.submit(queued).unwrap();
    let (refused, _refused_p) = request(prompt.clone(), SamplerConfig::greedy(), 8);
    assert_eq!(h.submit(refused).err(), Some(SubmitError::QueueFull(1)));
    // The client of the long request goes away: its slot serves the queued one.
    long_p.closed.store(true, Ordering::Release);
    let (text, c) = wait(&queued_p).unwrap();
    assert_eq!(c.completion_tokens, 8);
    assert!(!text.is_empty());
    let m = h.metrics();
    assert_eq!(m.requests_cancelled_total, 1);
    assert!(m.tokens_predicted_total < 400 + 8);
    h.shutdown(Duration::ZERO);
    t.join().unwrap();
}

#[test]
fn invalid_requests_fail_and_shutdown_cancels() {
    let mut cfg = config(2, None);
    cfg.n_ctx_slot = 16;
    let (h, t) = start(engine(false), cfg);
    let (r, p) = request((0..16).collect(), SamplerConfig::greedy(), 4);
    h.submit(r).unwrap();
    assert_eq!(wait(&p).err().map(|e| e.0), Some(FailKind::Invalid));
    let (r, p) = request(vec![1, 2, 9000], SamplerConfig::greedy(), 4);
    h.submit(r).unwrap();
    assert_eq!(wait(&p).err().map(|e| e.0), Some(FailKind::Invalid));
    let (r, p) = request(Vec::new(), SamplerConfig::greedy(), 4);
    h.submit(r).unwrap();
    assert_eq!(wait(&p).err().map(|e| e.0), Some(FailKind::Invalid));
    // A context-bound request ends with "length" when its slot's context is full.
    let (r, p) = request(vec![1, 2, 3], SamplerConfig::greedy(), 100);
    h.submit(r).unwrap();
    let (_, c) = wait(&p).unwrap();
    assert_eq!(
        (c.finish, c.completion_tokens),
        (crate::generate::FinishReason::Length, 14)
    );
    h.shutdown(Duration::ZERO);
    t.join().unwrap();
    let (r, _p) = request(vec![1], SamplerConfig::greedy(), 4);
    assert!(matches!(
        h.submit(r),
        Err(SubmitError::Stopped(_) | SubmitError::ShuttingDown)
    ));
}

#[test]
fn shutdown_cancels_running_work_after_the_grace_period() {
    let (h, t) = start(engine(true), config(2, Some(DraftPolicy::Auto)));
    let tok = engine(false).tokenizer.clone();
    let (r, p) = request(
        tok.encode(PROMPTS[3], true),
        SamplerConfig::greedy(),
        100_000,
    );
    h.submit(r).unwrap();
    loop {
        if let Event::Text(_) = p.rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            break;
        }
    }
    h.shutdown(Duration::from_millis(50));
    t.join().unwrap();
    let mut last = None;
    while let Ok(ev) = p.rx.try_recv() {
        last = Some(ev);
    }
    assert!(
        matches!(
            last,
            Some(Event::Failed {
                kind: FailKind::Shutdown,
                ..
            })
        ),
        "{last:?}"
    );
    assert_eq!(h.phase(), Phase::Stopped);
}

#[test]
fn lagging_heads_catch_up_in_pieces_and_drafting_resumes() {
    let tok = engine(false).tokenizer.clone();
    // A long prompt (more rows than one step's budget) and a long answer.
    let long_prompt = tok.encode(&PROMPTS[0].repeat(8), true);
    assert!(long_prompt.len() > 32);
    let short_prompt = tok.encode(PROMPTS[2], true);
    let want_a = reference_text(&long_prompt, SamplerConfig::greedy(), 300);
    let want_b = reference_text(&short_prompt, SamplerConfig::greedy(), 280);
    // Drafting only while one slot is busy: A drafts alone, stops while B runs (its head lag
    // passes the flush size), and drafts again once B is done.
    let mut cfg = config(2, Some(DraftPolicy::MaxSlots(1)));
    cfg.n_batch = 16;
    let (h, t) = start(engine(true), cfg);
    let (a, pa) = request(long_prompt, SamplerConfig::greedy(), 300);
    h.submit(a).unwrap();
    let mut got_a = String::new();
    // Let A run alone for a while before B arrives.
    while got_a.len() < 40 {
        match pa.rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Text(x) => got_a.push_str(&x),
            Event::Started { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let (b, pb) = request(short_prompt, SamplerConfig::greedy(), 280);
    h.submit(b).unwrap();
    let (rest_a, ca) = wait(&pa).unwrap();
    got_a.push_str(&rest_a);
    let (got_b, cb) = wait(&pb).unwrap();
    assert_eq!(got_a, want_a);
    assert_eq!(got_b, want_b);
    assert!(ca.draft_n > 0, "A drafted: {ca:?}");
    assert!(cb.completion_tokens == 280 && ca.completion_tokens == 300);
    h.shutdown(Duration::ZERO);
    t.join().unwrap();
}

#[test]
fn auto_retires_the_head_of_a_slot_that_never_drafts() {
    use super::core::Core;
    use super::cost::{CostModel, RowCost};
    let e = engine(true);
    let tok = e.tokenizer.clone();
    let prompt = tok.encode(PROMPTS[1], true);
    let want = reference_text(&prompt, SamplerConfig::greedy(), 120);
    let shared = Arc::new(Shared {
        phase: std::sync::atomic::AtomicU8::new(Phase::Ready as u8),
        inbox: std::sync::Mutex::new(Inbox {
            queue: Default::default(),
            shutdown: None,
        }),
        wake: std::sync::Condvar::new(),
        queue_capacity: std::sync::Mutex::new(4),
        info: std::sync::Mutex::new(None),
        failure: std::sync::Mutex::new(None),
        metrics: std::sync::Mutex::new(MetricsSnapshot::default()),
    });
    let mut core = Core::new(&e, &tok, config(2, Some(DraftPolicy::Auto)), shared);
    // Rows cost in proportion and head passes are dear: drafting never pays.
    let adverse = CostModel {
        target: RowCost::from_points(&[(1, 1.0), (64, 64.0)], 1.0),
        head: RowCost::from_points(&[(1, 5.0), (64, 100.0)], 1.0),
        per_slot_ms: 0.0,
        commit_ms: 0.2,
    };
    let (r1, p1) = request(prompt.clone(), SamplerConfig::greedy(), 120);
    let (r2, p2) = request(prompt, SamplerConfig::greedy(), 120);
    core.admit(r1);
    core.admit(r2);
    let mut retired = false;
    while core.busy() > 0 {
        // Steps also learn the real costs; keep pricing with the adverse ones.
        core.cost = adverse.clone();
        core.step().unwrap();
        retired |= core.slots.iter().flatten().all(|s| s.head.is_none());
    }
    assert!(retired, "the heads of non-drafting slots were retired");
    for p in [p1, p2] {
        let (text, c) = wait(&p).unwrap();
        assert_eq!(text, want);
        assert_eq!(c.draft_n, 0);
    }
}
