//! The generation loop with many requests: each request's tokens are what it gets alone, however
//! the steps batch it with others; cancellation, the bounded queue, invalid requests, shutdown.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::{generate_many, plain_reference, Setup};
use nextn_engine::output::FinishReason;
use nextn_engine::sampler::SamplerConfig;
use nextn_engine::scheduler::{
    spawn, Completion, DraftPolicy, DraftSampling, Engine, Event, EventSink, FailKind, Phase,
    Request, SchedulerConfig, SchedulerHandle, SpecConfig, SubmitError,
};
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use nextn_model::{KvType, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;

fn engine(with_head: bool) -> Engine {
    let file =
        Arc::new(GgufFile::open(nextn_testdata::bundled_model()).expect("open bundled model"));
    let model = Model::load(file.clone()).expect("load model");
    let head = with_head.then(|| NextnHead::load(&model).expect("load head"));
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).expect("tokenizer"));
    Engine {
        model,
        head,
        tokenizer,
        pool: ThreadPool::new(2),
        vision: None,
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
        spec: policy.map(|_| SpecConfig {
            n_max: 3,
            ..SpecConfig::default()
        }),
        policy: policy.unwrap_or(DraftPolicy::ALWAYS),
        calibrate: true,
        prefix_cache: None,
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
        trace: false,
        grammar: None,
        logprobs: None,
        cache_prompt: false,
        cache_points: Vec::new(),
        forced_acceptance: None,
        images: Vec::new(),
        prompt_progress: false,
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
            Event::Started { .. } | Event::Logprobs(_) | Event::PromptProgress { .. } => {}
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

fn tokenizer() -> Arc<Tokenizer> {
    engine(false).tokenizer
}

/// What plain decoding emits for `prompt`.
fn reference(prompt: &[u32], sampler: SamplerConfig, n: usize) -> Vec<u32> {
    let l = common::bundled(2);
    plain_reference(&l, prompt, &sampler, n, &Setup::plain()).0
}

const PROMPTS: [&str; 4] = [
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "# Return the factorial of n.\ndef factorial(n):\n",
    "The quick brown fox",
];

#[test]
fn one_request_gives_plain_decoding_in_every_mode() {
    let prompt = tokenizer().encode(PROMPTS[0], true);
    let tok = tokenizer();
    let want = reference(&prompt, SamplerConfig::greedy(), 48);
    for (with_head, policy) in [
        (false, None),
        (true, Some(DraftPolicy::Auto)),
        (true, Some(DraftPolicy::MaxSlots(4))),
    ] {
        let (h, t) = start(engine(with_head), config(2, policy));
        let (r, p) = request(prompt.clone(), SamplerConfig::greedy(), 48);
        h.submit(r).unwrap();
        let (text, c) = wait(&p).unwrap();
        assert_eq!(c.tokens, want, "policy {policy:?}");
        assert_eq!(text, tok.decode(&want), "policy {policy:?}");
        assert_eq!(c.completion_tokens, 48);
        assert_eq!(c.prompt_tokens, prompt.len());
        if policy == Some(DraftPolicy::MaxSlots(4)) {
            assert!(
                c.spec.draft_n > 0 && c.spec.draft_n_accepted <= c.spec.draft_n,
                "{c:?}"
            );
        }
        let m = h.metrics();
        assert_eq!(m.tokens_predicted_total, 48);
        assert_eq!(m.prompt_tokens_total, prompt.len() as u64);
        assert_eq!(m.spec_draft_tokens_total, c.spec.draft_n);
        assert_eq!(m.spec_accepted_tokens_total, c.spec.draft_n_accepted);
        assert!(m.spec_accepted_per_pos_total.first().copied().unwrap_or(0) <= m.spec_drafts_total);
        h.shutdown(Duration::ZERO);
        t.join().unwrap();
    }
}

/// p/q acceptance draws depend on what the slot drafted, but not on the other slots: with every
/// slot drafting every step, a request gives the same tokens alone and beside others.
#[test]
fn sampled_drafts_do_not_depend_on_other_slots() {
    let l = common::bundled(2);
    let target = l.tok.encode(PROMPTS[3], true);
    let cfg = SamplerConfig {
        temperature: 0.8,
        seed: 77,
        ..SamplerConfig::default()
    };
    let mut setup = Setup::drafting(3);
    if let Some(s) = setup.spec.as_mut() {
        s.draft_sampling = DraftSampling::Sample;
    }
    let alone = generate_many(&l, &setup, 1, &[(target.clone(), cfg.clone(), 40)]).remove(0);
    let mut batch: Vec<(Vec<u32>, SamplerConfig, usize)> = (0..4)
        .map(|i| {
            let p = l.tok.encode(PROMPTS[i % 4], true);
            let s = SamplerConfig {
                seed: i as u64,
                ..cfg.clone()
            };
            (p, s, 30 + i)
        })
        .collect();
    batch.insert(2, (target, cfg, 40));
    let together = generate_many(&l, &setup, 5, &batch);
    assert_eq!(together[2].tokens, alone.tokens);
    assert_eq!(
        (together[2].spec.draft_n, together[2].spec.draft_n_accepted),
        (alone.spec.draft_n, alone.spec.draft_n_accepted)
    );
    assert!(alone.spec.draft_n > 0);
}

#[test]
fn output_does_not_depend_on_what_else_runs() {
    let tok = tokenizer();
    let target = tok.encode(PROMPTS[1], true);
    let seeded = SamplerConfig {
        temperature: 0.9,
        seed: 1234,
        ..SamplerConfig::default()
    };
    let alone_greedy = reference(&target, SamplerConfig::greedy(), 40);
    let alone_seeded = reference(&target, seeded.clone(), 40);
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
        assert_eq!(
            results[5].1.tokens, alone_greedy,
            "greedy, policy {policy:?}"
        );
        assert_eq!(
            results[11].1.tokens, alone_seeded,
            "seeded, policy {policy:?}"
        );
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
            results.iter().map(|r| r.1.spec.draft_n).sum::<u64>()
        );
        h.shutdown(Duration::ZERO);
        t.join().unwrap();
    }
}

/// A request that asks for prompt progress hears when it starts (nothing processed yet) and
/// after every prompt chunk (the loop's `n_batch` rows), all before its first text; one that
/// does not ask hears none.
#[test]
fn prompt_progress_comes_per_chunk_before_the_answer() {
    let (h, t) = start(engine(true), config(1, Some(DraftPolicy::Auto)));
    let prompt = tokenizer().encode(&PROMPTS[2].repeat(16), true);
    assert!(prompt.len() > 3 * 64, "{} tokens", prompt.len());
    let (mut r, p) = request(prompt.clone(), SamplerConfig::greedy(), 4);
    r.prompt_progress = true;
    h.submit(r).unwrap();
    let mut seen = Vec::new();
    loop {
        match p.rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::PromptProgress {
                total,
                cache,
                processed,
                time_ms,
            } => {
                assert_eq!((total, cache), (prompt.len(), 0));
                assert!(time_ms >= 0.0);
                seen.push(processed);
            }
            Event::Text(_) | Event::Done(_) => break,
            Event::Started { .. } | Event::Logprobs(_) => {}
            Event::Failed { message, .. } => panic!("{message}"),
        }
    }
    let want: Vec<usize> = std::iter::once(0)
        .chain((64..prompt.len()).step_by(64))
        .chain(std::iter::once(prompt.len()))
        .collect();
    assert_eq!(seen, want);
    let (plain, plain_p) = request(prompt, SamplerConfig::greedy(), 4);
    h.submit(plain).unwrap();
    while let Ok(e) = plain_p.rx.recv_timeout(Duration::from_secs(60)) {
        assert!(!matches!(e, Event::PromptProgress { .. }), "{e:?}");
        if matches!(e, Event::Done(_)) {
            break;
        }
    }
    h.shutdown(Duration::ZERO);
    t.join().unwrap();
}

#[test]
fn a_closed_sink_frees_its_slot_and_the_queue_is_bounded() {
    let mut cfg = config(1, Some(DraftPolicy::Auto));
    cfg.queue_capacity = 1;
    let (h, t) = start(engine(true), cfg);
    let prompt = tokenizer().encode(PROMPTS[2], true);
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
    let (kind, message) = wait(&p).err().unwrap();
    assert_eq!(kind, FailKind::Invalid);
    assert!(message.contains("the context holds 16"), "{message}");
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
    assert_eq!((c.finish, c.completion_tokens), (FinishReason::Length, 14));
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
    let (r, p) = request(
        tokenizer().encode(PROMPTS[3], true),
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
    let tok = tokenizer();
    // A long prompt (more rows than one step's budget) and a long answer.
    let long_prompt = tok.encode(&PROMPTS[0].repeat(8), true);
    assert!(long_prompt.len() > 32);
    let short_prompt = tok.encode(PROMPTS[2], true);
    let want_a = reference(&long_prompt, SamplerConfig::greedy(), 300);
    let want_b = reference(&short_prompt, SamplerConfig::greedy(), 280);
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
    assert_eq!(ca.tokens, want_a);
    assert_eq!(cb.tokens, want_b);
    assert_eq!(got_a, tok.decode(&want_a));
    assert_eq!(got_b, tok.decode(&want_b));
    assert!(ca.spec.draft_n > 0, "A drafted: {ca:?}");
    assert!(cb.completion_tokens == 280 && ca.completion_tokens == 300);
    h.shutdown(Duration::ZERO);
    t.join().unwrap();
}
