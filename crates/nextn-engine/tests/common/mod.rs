//! What the generation-loop tests share: loading a model with its head, one request through the
//! loop, and plain decoding written out step by step as the reference the loop must reproduce.

#![allow(dead_code)]

use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;

use nextn_engine::grammar::Constraint;
use nextn_engine::output::FinishReason;
use nextn_engine::sampler::{Sampler, SamplerConfig, TokenLogprob};
use nextn_engine::scheduler::{
    Completion, DraftPolicy, EngineRef, Event, EventSink, PrefixCacheConfig, Request, Scheduler,
    SchedulerConfig,
};
use nextn_engine::speculative::SpecConfig;
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use nextn_model::{KvType, LogitRows, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;

pub struct Loaded {
    pub model: Model,
    pub head: NextnHead,
    pub tok: Tokenizer,
    pub pool: ThreadPool,
}

impl Loaded {
    pub fn engine(&self, with_head: bool) -> EngineRef<'_> {
        EngineRef {
            vision: None,
            model: &self.model,
            head: with_head.then_some(&self.head),
            tokenizer: &self.tok,
            pool: &self.pool,
        }
    }
}

pub fn load(path: &Path, threads: usize) -> Loaded {
    let file = Arc::new(GgufFile::open(path).expect("open model"));
    let model = Model::load(file.clone()).expect("load model");
    let head = NextnHead::load(&model).expect("load head");
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    Loaded {
        model,
        head,
        tok,
        pool: ThreadPool::new(threads),
    }
}

pub fn bundled(threads: usize) -> Loaded {
    load(&nextn_testdata::bundled_model(), threads)
}

/// The bundled model, and with ../shared the dense Q4_K_M and MoE Q8_0 fixtures.
pub fn bundled_and_fixtures(threads: usize) -> Vec<Loaded> {
    let mut out = vec![bundled(threads)];
    if let Some(golden) = nextn_testdata::shared("golden") {
        for f in [
            "q35-dense-a/q35-dense-a-Q4_K_M.gguf",
            "q35moe-a/q35moe-a-Q8_0.gguf",
        ] {
            out.push(load(&golden.join(f), threads));
        }
    }
    out
}

/// How one request runs.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Speculative decoding (`None`: plain).
    pub spec: Option<SpecConfig>,
    pub policy: DraftPolicy,
    pub n_ctx: usize,
    pub n_batch: usize,
    pub kv: KvType,
    pub ignore_eos: bool,
    pub trace: bool,
    pub prefix_cache: Option<PrefixCacheConfig>,
}

impl Setup {
    pub fn plain() -> Self {
        Setup {
            spec: None,
            policy: DraftPolicy::ALWAYS,
            n_ctx: 512,
            n_batch: 512,
            kv: KvType::F16,
            ignore_eos: true,
            trace: false,
            prefix_cache: None,
        }
    }

    pub fn drafting(n_max: usize) -> Self {
        Setup {
            spec: Some(SpecConfig {
                n_max,
                ..SpecConfig::default()
            }),
            ..Setup::plain()
        }
    }
}

/// Hands a request's end back; text is not needed (tokens come with the completion).
pub struct Collect(pub mpsc::Sender<Event>);

impl EventSink for Collect {
    fn send(&mut self, event: Event) -> bool {
        match event {
            Event::Done(_) | Event::Failed { .. } | Event::Logprobs(_) => {
                self.0.send(event).is_ok()
            }
            _ => true,
        }
    }

    fn is_closed(&self) -> bool {
        false
    }
}

/// One request for [`generate_jobs`].
pub struct Job {
    /// Prompt positions to keep a prefix-cache snapshot at.
    pub cache_points: Vec<usize>,
    pub prompt: Vec<u32>,
    pub sampler: SamplerConfig,
    pub n: usize,
    pub grammar: Option<Constraint>,
    pub logprobs: Option<usize>,
}

/// Several requests through the generation loop on `n_slots` slots; their completions in order.
pub fn generate_many(
    l: &Loaded,
    setup: &Setup,
    n_slots: usize,
    requests: &[(Vec<u32>, SamplerConfig, usize)],
) -> Vec<Completion> {
    let jobs = requests
        .iter()
        .map(|(prompt, sampler, n)| Job {
            cache_points: Vec::new(),
            prompt: prompt.clone(),
            sampler: sampler.clone(),
            n: *n,
            grammar: None,
            logprobs: None,
        })
        .collect();
    generate_jobs(l, setup, n_slots, jobs)
        .into_iter()
        .map(|(c, _)| c)
        .collect()
}

/// Requests with grammars and log probabilities through the loop; each one's completion and the
/// log probabilities it was sent.
pub fn generate_jobs(
    l: &Loaded,
    setup: &Setup,
    n_slots: usize,
    jobs: Vec<Job>,
) -> Vec<(Completion, Vec<TokenLogprob>)> {
    let mut scheduler = scheduler(l, setup, n_slots, jobs.len());
    run_jobs(&mut scheduler, setup, jobs)
}

/// A local scheduler for `setup`.
pub fn scheduler<'l>(l: &'l Loaded, setup: &Setup, n_slots: usize, queue: usize) -> Scheduler<'l> {
    Scheduler::new(
        l.engine(setup.spec.is_some()),
        SchedulerConfig {
            n_slots,
            n_ctx_slot: setup.n_ctx,
            k_type: setup.kv,
            v_type: setup.kv,
            n_batch: setup.n_batch,
            queue_capacity: queue,
            spec: setup.spec.clone(),
            policy: setup.policy,
            calibrate: false,
            prefix_cache: setup.prefix_cache.clone(),
        },
    )
}

/// Run `jobs` on `scheduler` until they are done.
pub fn run_jobs(
    scheduler: &mut Scheduler<'_>,
    setup: &Setup,
    jobs: Vec<Job>,
) -> Vec<(Completion, Vec<TokenLogprob>)> {
    run_jobs_with(scheduler, setup, jobs, true)
}

/// [`run_jobs`] with `cache_prompt` set for every job.
pub fn run_jobs_with(
    scheduler: &mut Scheduler<'_>,
    setup: &Setup,
    jobs: Vec<Job>,
    cache_prompt: bool,
) -> Vec<(Completion, Vec<TokenLogprob>)> {
    let mut ends = Vec::new();
    for job in jobs {
        let (tx, rx) = mpsc::channel();
        scheduler.submit(Request {
            prompt: job.prompt,
            sampler: job.sampler,
            n_predict: Some(job.n),
            stop: Vec::new(),
            ignore_eos: setup.ignore_eos,
            trace: setup.trace,
            grammar: job.grammar,
            logprobs: job.logprobs,
            cache_prompt,
            cache_points: job.cache_points,
            forced_acceptance: None,
            images: Vec::new(),
            prompt_progress: false,
            sink: Box::new(Collect(tx)),
        });
        ends.push(rx);
    }
    scheduler.run();
    ends.iter()
        .map(|rx| {
            let mut logprobs = Vec::new();
            loop {
                match rx.try_recv() {
                    Ok(Event::Logprobs(lp)) => logprobs.extend(lp),
                    Ok(Event::Done(c)) => return (c, logprobs),
                    other => panic!("the request did not complete: {other:?}"),
                }
            }
        })
        .collect()
}

/// One request through the generation loop on one slot.
pub fn generate(
    l: &Loaded,
    setup: &Setup,
    prompt: &[u32],
    sampler: &SamplerConfig,
    n: usize,
) -> Completion {
    generate_many(l, setup, 1, &[(prompt.to_vec(), sampler.clone(), n)]).remove(0)
}

/// Plain decoding written out: prefill in chunks of `n_batch`, then one forward pass and one draw
/// per token, the token at output position i drawn with `Sampler::sample(row, i)`; stops after
/// `n` tokens, at an end-of-generation token (unless `ignore_eos`) or when the context is full.
pub fn plain_reference(
    l: &Loaded,
    prompt: &[u32],
    sampler: &SamplerConfig,
    n: usize,
    setup: &Setup,
) -> (Vec<u32>, FinishReason) {
    let r = constrained_reference(l, prompt, sampler, n, setup, None);
    (r.tokens, r.finish)
}

/// What [`constrained_reference`] decodes.
pub struct Reference {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    /// The row each token was drawn from (raw logits).
    pub rows: Vec<Vec<f32>>,
}

/// [`plain_reference`] under a grammar: each row masked by the grammar's state before the draw
/// (`Sampler::sample_masked`), each token consumed; a token that completes the grammar is the
/// last one.
pub fn constrained_reference(
    l: &Loaded,
    prompt: &[u32],
    sampler: &SamplerConfig,
    n: usize,
    setup: &Setup,
    mut grammar: Option<Constraint>,
) -> Reference {
    let pool = &l.pool;
    let mut state = l
        .model
        .new_sequence(setup.n_ctx, setup.kv, setup.kv)
        .unwrap();
    let chunks: Vec<&[u32]> = prompt.chunks(setup.n_batch).collect();
    let mut logits = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let rows = if i + 1 == chunks.len() {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        logits = l
            .model
            .forward(chunk, &mut state, rows, pool)
            .expect("prefill")
            .logits;
    }
    let mut s = Sampler::new(sampler.clone()).expect("sampler");
    for &t in prompt {
        s.accept(t);
    }
    let mut r = Reference {
        tokens: Vec::new(),
        finish: FinishReason::Length,
        rows: Vec::new(),
    };
    loop {
        let mask = grammar.as_mut().map(|g| g.mask().expect("grammar mask"));
        let t = s.sample_masked_and_accept(&logits, mask.as_ref(), r.tokens.len() as u64);
        if l.tok.is_eog(t) && !setup.ignore_eos {
            r.finish = FinishReason::Stop;
            return r;
        }
        r.tokens.push(t);
        r.rows.push(logits.clone());
        if let Some(g) = grammar.as_mut() {
            g.consume(t).expect("the grammar takes its own token");
            if g.is_finished() {
                r.finish = FinishReason::Stop;
                return r;
            }
        }
        // The token sits at position n_past; a full context ends generation with it.
        if r.tokens.len() >= n || state.n_past >= setup.n_ctx {
            return r;
        }
        logits = l
            .model
            .forward(&[t], &mut state, LogitRows::Last, pool)
            .expect("decode")
            .logits;
    }
}
