//! What needs the loop's insides: the `auto` policy retires the head of a slot that never drafts;
//! the head's lag stays bounded through a long prompt.

use std::sync::mpsc;
use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_model::{KvType, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;

use super::core::Core;
use super::cost::{CostModel, RowCost};
use super::policy::LAG_FLUSH;
use super::*;

struct TestSink(mpsc::Sender<Event>);

impl EventSink for TestSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        false
    }
}

fn shared() -> Arc<Shared> {
    Shared::new(Phase::Ready, 4)
}

fn bundled() -> (Model, NextnHead, Tokenizer) {
    let file =
        Arc::new(GgufFile::open(nextn_testdata::bundled_model()).expect("open bundled model"));
    let model = Model::load(file.clone()).expect("load model");
    let head = NextnHead::load(&model).expect("load head");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    (model, head, tokenizer)
}

fn config(spec: bool, policy: DraftPolicy, n_ctx: usize) -> SchedulerConfig {
    SchedulerConfig {
        n_slots: 2,
        n_ctx_slot: n_ctx,
        k_type: KvType::F16,
        v_type: KvType::F16,
        n_batch: 64,
        queue_capacity: 4,
        spec: spec.then(SpecConfig::default),
        policy,
        calibrate: false,
        prefix_cache: None,
    }
}

fn request(prompt: &[u32], n: usize) -> (Request, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    let r = Request {
        prompt: prompt.to_vec(),
        sampler: SamplerConfig::greedy(),
        n_predict: Some(n),
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
        sink: Box::new(TestSink(tx)),
    };
    (r, rx)
}

fn completion(rx: &mpsc::Receiver<Event>) -> Completion {
    loop {
        match rx.try_recv() {
            Ok(Event::Done(c)) => return c,
            Ok(Event::Failed { message, .. }) => panic!("{message}"),
            Ok(_) => {}
            Err(e) => panic!("no completion: {e}"),
        }
    }
}

/// What plain decoding gives for `prompt`, through the same loop without a head.
fn plain_tokens(engine: EngineRef, n_ctx: usize, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut plain = Scheduler::new(
        EngineRef {
            vision: None,
            head: None,
            ..engine
        },
        config(false, DraftPolicy::ALWAYS, n_ctx),
    );
    let (r, rx) = request(prompt, n);
    plain.submit(r);
    plain.run();
    completion(&rx).tokens
}

#[test]
fn auto_retires_the_head_of_a_slot_that_never_drafts() {
    let (model, head, tokenizer) = bundled();
    let pool = ThreadPool::new(2);
    let engine = EngineRef {
        vision: None,
        model: &model,
        head: Some(&head),
        tokenizer: &tokenizer,
        pool: &pool,
    };
    let prompt = tokenizer.encode("class Stack:\n    def __init__(self):\n", true);
    let want = plain_tokens(engine, 512, &prompt, 120);

    let mut core = Core::new(engine, config(true, DraftPolicy::Auto, 512), shared());
    // Rows cost in proportion and head passes are dear: drafting never pays.
    let adverse = CostModel {
        target: RowCost::from_points(&[(1, 1.0), (64, 64.0)], 1.0),
        head: RowCost::from_points(&[(1, 5.0), (64, 100.0)], 1.0),
        per_slot_ms: 0.0,
        commit_ms: 0.2,
    };
    let (r1, rx1) = request(&prompt, 120);
    let (r2, rx2) = request(&prompt, 120);
    core.admit(r1);
    core.admit(r2);
    let mut retired = false;
    while core.busy() > 0 {
        // Steps also learn the real costs; keep pricing with the adverse ones.
        core.cost = adverse.clone();
        core.step().unwrap();
        retired |= core.slots.iter().flatten().all(|s| !s.spec.has_head());
    }
    assert!(retired, "the heads of non-drafting slots were retired");
    for rx in [rx1, rx2] {
        let c = completion(&rx);
        assert_eq!(c.tokens, want);
        assert_eq!(c.spec.draft_n, 0);
    }
}

/// A prompt much longer than a step's rows: the head catches up while the target prefills, so
/// the hidden states it holds stay bounded, and the output is still plain decoding's.
#[test]
fn head_lag_stays_bounded_through_a_long_prompt() {
    let (model, head, tokenizer) = bundled();
    let pool = ThreadPool::new(2);
    let engine = EngineRef {
        vision: None,
        model: &model,
        head: Some(&head),
        tokenizer: &tokenizer,
        pool: &pool,
    };
    let prompt = tokenizer.encode(&"import os\nimport sys\n".repeat(200), true);
    assert!(prompt.len() > 4 * LAG_FLUSH, "{}", prompt.len());
    let want = plain_tokens(engine, 2048, &prompt, 24);
    for policy in [DraftPolicy::ALWAYS, DraftPolicy::Auto] {
        let mut core = Core::new(engine, config(true, policy, 2048), shared());
        let (r, rx) = request(&prompt, 24);
        core.admit(r);
        let mut most = 0;
        while core.busy() > 0 {
            core.step().unwrap();
            for s in core.slots.iter().flatten() {
                most = most.max(s.spec.head_lag().unwrap_or(0));
            }
        }
        assert!(
            most < LAG_FLUSH + 64,
            "{policy:?}: the head lagged {most} rows"
        );
        let c = completion(&rx);
        assert_eq!(c.tokens, want, "{policy:?}");
        if policy == DraftPolicy::ALWAYS {
            assert!(c.spec.draft_n > 0, "{:?}", c.spec);
        }
    }
}
