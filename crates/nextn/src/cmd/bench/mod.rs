//! `nextn bench`: plain decoding against MTP speculative decoding at several draft depths (and
//! the adaptive `auto` policy) on the same prompts, each run through the generation loop the
//! server uses, plus the cost model behind the speed (decode step, verify of r rows, draft step)
//! and the speedup those costs project at a given per-position acceptance.

mod depth;
mod draft_vocab;
mod floor;
mod images;
mod plot;
mod union;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nextn_engine::grammar::{GrammarCompiler, GrammarSource};
use nextn_engine::sampler::{argmax, SamplerConfig};
use nextn_engine::scheduler::{DraftPolicy, Event, EventSink, Request, Scheduler, SchedulerConfig};
use nextn_engine::speculative::forced::ForcedAcceptance;
use nextn_engine::speculative::{DraftSampling, SpecConfig, SpecStats};
use nextn_model::device::{DeviceModel, DeviceProgress};
use nextn_model::{LayerCache, LogitRows, NextnHead};
use serde_json::{json, Value};

use super::common::{self, DraftVocabArgs, GrammarArgs, Loaded, ModelArgs, VisionArgs};
use floor::FloorArgs;

/// The default prompt set: code and prose.
const DEFAULT_PROMPTS: &str = include_str!("../../../bench/prompts.jsonl");

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompts as JSON lines {"name": ..., "prompt": ...} (default: the built-in code and prose set)
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Tokens generated per prompt
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n_predict: usize,
    /// Draft depths to run: 0 is plain decoding, N drafts N tokens every step, `auto` decides per
    /// step from measured costs and acceptance (as `serve` does) with up to the largest N given
    #[arg(
        long = "spec-draft-n-max",
        value_delimiter = ',',
        default_value = "0,1,2,3,4"
    )]
    pub n_max: Vec<String>,
    /// Per-position acceptance to project the speedup at (e.g. published numbers for a real model)
    #[arg(
        long = "assume-acceptance",
        value_delimiter = ',',
        default_value = "0.95,0.86,0.75"
    )]
    pub assume_acceptance: Vec<f64>,
    /// Run the speculative loop at this per-position acceptance (marginal rates, non-increasing;
    /// e.g. a real model's published numbers): the head drafts and the target verifies as always,
    /// but each step keeps draft i with the given rate, the kept drafts being the tokens the plain
    /// run produced, so the output stays plain decoding's and every cost of the loop is real.
    /// The speedup is then measured, next to the cost model's projection at the same rates
    #[arg(long = "force-acceptance", value_delimiter = ',', value_name = "RATES")]
    pub force_acceptance: Vec<f64>,
    /// Repetitions of each cost-model measurement (the median is reported)
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// Sampling temperature for the runs (0 = greedy); above 0 both draft-sampling modes (coupled
    /// and sample) are run
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temp: f32,
    /// Seed for sampled runs
    #[arg(short = 's', long = "seed", default_value_t = 42)]
    pub seed: u64,
    /// Also check the head: SPEC_AGREE (MTP output equals plain output), DRAFT_TOP1 (teacher-forced
    /// head top-1 equals the target's top-1) and mean KL(target ‖ head) over the prompts
    #[arg(long)]
    pub check: bool,
    /// With --check: the same checks, and the acceptance at the largest draft depth, for this
    /// other file of the same model (say the source of a quantized or grafted file), printed
    /// next to this model's
    #[arg(long = "check-against", value_name = "FILE", requires = "check")]
    pub check_against: Option<PathBuf>,
    /// Also write the results as JSON to this file
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Runs of each configuration; with more than one, tokens/s are given as mean ± standard
    /// deviation (as llama-bench's -r)
    #[arg(short = 'r', long = "repetitions", default_value_t = 1)]
    pub repetitions: usize,
    /// What stdout gets: the text report, or the table of runs as md, csv, json or jsonl (as
    /// llama-bench's -o; the text report then goes to stderr)
    #[arg(short = 'o', long = "output", default_value = "text", value_parser = ["text", "md", "csv", "json", "jsonl"])]
    pub output: String,
    /// Draw acceptance by draft position and decode tokens/s by depth into this PNG
    #[arg(long = "plot", value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// On a device (-dev): time every dispatch of the generation runs' passes and print the
    /// device time by kernel (where the device can write timestamps inside a pass; the extra
    /// timestamps cost the runs a little speed)
    #[arg(long = "device-profile", conflicts_with_all = ["depth", "expert_union"])]
    pub device_profile: bool,
    /// Instead of the generation runs, time the passes of the loop (decode, verify of up to
    /// --floor-verify-rows rows, draft step) after a prefill of N tokens, for each N given (as
    /// llama-bench's -d); the prefill's rate is given without and with the head's pass over the
    /// same rows, and the head's share of it
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', value_name = "N")]
    pub depth: Vec<usize>,
    /// With -d: prefill only the first N tokens and fill the attention caches up to each depth
    /// with copies of those positions' keys and values (a pass's cost depends on how many
    /// positions it attends to, not on their values), to time depths whose real prefill would
    /// take hours; the prefill rate reported is that of the N computed tokens
    #[arg(long = "depth-fill", value_name = "N", requires = "depth")]
    pub depth_fill: Option<usize>,
    /// Mixture-of-experts models: instead of the generation runs, time verify passes of 2 to
    /// --floor-verify-rows rows at every number of distinct experts their rows can pick (from
    /// all rows sharing the same ones to none shared), with the MTP speedup each would give at
    /// --assume-acceptance. Random weights route at random, so their own passes show only the
    /// unshared end; a trained model's consecutive tokens share more
    #[arg(long = "expert-union", conflicts_with = "depth")]
    pub expert_union: bool,
    #[command(flatten)]
    pub floor: FloorArgs,
    #[command(flatten)]
    pub draft_vocab: DraftVocabArgs,
    /// Constrain every run's output (a grammar or a JSON Schema, as for `run`)
    #[command(flatten)]
    pub grammar: GrammarArgs,
    /// The vision tower whose encodes --image times (and its token bounds and placement flags)
    #[command(flatten)]
    pub vision: VisionArgs,
    /// Instead of the generation runs, time the vision tower's encode of each image given (after
    /// one encode that warms it up; -r encodes each), the tower placed as `run` and `serve`
    /// place it: on the model's device unless --no-mmproj-offload, else on the CPU with -t threads
    #[arg(long = "image", value_name = "FILE", conflicts_with_all = ["depth", "expert_union", "device_profile"])]
    pub image: Vec<PathBuf>,
    /// With a grammar: pick drafts among the tokens it allows (on), or ignore it while drafting
    /// (off; verification alone enforces it); `on,off` measures both
    #[arg(long = "draft-mask", value_delimiter = ',', default_value = "on", value_parser = ["on", "off"])]
    pub draft_mask: Vec<String>,
}

struct Prompt {
    name: String,
    tokens: Vec<u32>,
}

fn read_prompts(loaded: &Loaded, path: Option<&PathBuf>) -> Result<Vec<Prompt>> {
    let text = match path {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("cannot read prompts {}", p.display()))?,
        None => DEFAULT_PROMPTS.to_string(),
    };
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("prompts line {}: not JSON", i + 1))?;
        let Some(prompt) = v["prompt"].as_str() else {
            bail!("prompts line {}: no \"prompt\" string", i + 1)
        };
        let name = v["name"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("prompt{}", i + 1));
        let tokens = loaded.tokenizer.encode(prompt, true);
        if tokens.is_empty() {
            bail!("prompts line {}: the prompt is empty", i + 1);
        }
        out.push(Prompt { name, tokens });
    }
    if out.is_empty() {
        bail!("no prompts");
    }
    Ok(out)
}

/// Peak resident set size of this process (Linux `VmHWM`).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// User + system CPU seconds this process has used.
fn process_cpu_seconds() -> Option<f64> {
    #[cfg(unix)]
    {
        let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage writes a whole rusage into the pointer it is given.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr()) };
        if rc != 0 {
            return None;
        }
        // SAFETY: initialised by the successful call above.
        let u = unsafe { u.assume_init() };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        Some(secs(u.ru_utime) + secs(u.ru_stime))
    }
    #[cfg(not(unix))]
    None
}

/// What a run cost on the device: per pass (target and head forward passes) the device time by
/// timestamp queries, the dispatches, and per token (prompt and generated) the dispatches and
/// the host's CPU time; and in the steady state of its requests (`steady`, from the
/// [`STEADY_AFTER_TEXTS`]-th piece of text of each request to its end) what a pass creates
/// (buffers, bind groups, pipelines: none once a request's shapes have been seen) and what a step
/// of the generation loop costs the host: dispatches, submissions and waits for the device. On a
/// software device (lavapipe) the "device" time is CPU time too: labelled so.
/// A kernel's achieved bandwidth: the bytes its dispatches must move over their time.
fn achieved(t: &nextn_model::device::KernelTime) -> Option<f64> {
    (t.seconds > 0.0 && t.bytes > 0).then(|| t.bytes as f64 / t.seconds)
}

/// The fewest workgroups one of a kernel's dispatches launched, marked `*` when fewer than the
/// device's compute units (some of them then idle during that dispatch).
fn groups_cell(fewest: u64, compute_units: Option<u32>) -> String {
    let under = compute_units.is_some_and(|n| fewest < n as u64);
    format!("{fewest}{}", if under { "*" } else { "" })
}

fn device_report(
    device: &DeviceModel,
    tokens: usize,
    cpu_seconds: Option<f64>,
    steady: &DeviceProgress,
    copy_bandwidth: Option<f64>,
) -> (String, Value) {
    let s = device.take_stats();
    let info = &device.gpu().info;
    let per_pass = |x: f64| x / s.passes.max(1) as f64;
    let tok = tokens.max(1) as f64;
    let gpu_ms =
        (s.timed_submissions > 0).then(|| s.gpu_seconds * 1e3 / s.timed_submissions as f64);
    let r = &steady.runtime;
    let passes = steady.passes.max(1) as f64;
    let steps = steady.target_passes.max(1) as f64;
    let line = format!(
        "  device {}{}: {} passes{}, {} threads a weight row in the int8 products, {}, {:.0} dispatches per pass, {:.0} per token (prompt and generated), {:.1} KiB read back per token, {} per submission, host CPU {} per token\n  \
         steady state ({} steps, {} passes): per step {:.0} dispatches, {:.2} submissions, {:.2} waits for the device; per pass {:.2} buffers, {:.2} bind groups and {:.2} pipelines created",
        info.name,
        if info.software { " (software: its times are CPU times)" } else { "" },
        s.passes,
        if s.crossings > 0 {
            format!(" ({} crossings to the CPU's experts within them)", s.crossings)
        } else {
            String::new()
        },
        device.gpu().row_threads(),
        match device.gpu().subgroup_lanes() {
            1 => "reductions in workgroup memory".to_string(),
            n => format!("reductions ending in subgroups of {n}"),
        },
        per_pass(s.runtime.dispatches as f64),
        s.runtime.dispatches as f64 / tok,
        s.read_back_bytes as f64 / tok / 1024.0,
        gpu_ms.map_or("no timestamps".to_string(), |m| format!("{m:.2} ms device time")),
        cpu_seconds.map_or("?".to_string(), |c| format!("{:.2} ms", c * 1e3 / tok)),
        steady.target_passes,
        steady.passes,
        r.dispatches as f64 / steps,
        r.submissions as f64 / steps,
        r.read_backs as f64 / steps,
        r.buffers_created as f64 / passes,
        r.bind_groups_created as f64 / passes,
        r.pipelines_created as f64 / passes,
    );
    let mut line = line;
    let mut kernels: Vec<(&str, nextn_model::device::KernelTime)> =
        s.kernels.iter().map(|(k, t)| (*k, *t)).collect();
    kernels.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
    if !kernels.is_empty() {
        let profiled = s.profiled_seconds.max(1e-12);
        let passes = s.timed_submissions.max(1) as f64;
        line.push_str(&format!(
            "\n  device time by kernel ({:.2} ms per submission; a dispatch's time runs from the end of the one before it; groups: workgroups a dispatch launches, on average and the fewest{}; GB/s: the fewest bytes its dispatches move, read and written, over their time{}):\n  {:<28} {:>10} {:>10} {:>12} {:>7} {:>8} {:>8} {:>9} {:>7}",
            profiled * 1e3 / passes,
            info.compute_units.map_or(String::new(), |n| format!(
                ", * where fewer than the device's {n} compute units"
            )),
            copy_bandwidth.map_or(String::new(), |c| format!(
                "; % copy: of the device's copy bandwidth, {:.1} GB/s",
                c / 1e9
            )),
            "kernel",
            "per subm.",
            "us each",
            "ms per subm.",
            "share",
            "groups",
            "fewest",
            "GB/s",
            "% copy"
        ));
        for (k, t) in &kernels {
            let rate = achieved(t);
            let groups = t.workgroups as f64 / t.dispatches.max(1) as f64;
            line.push_str(&format!(
                "\n  {:<28} {:>10.1} {:>10.2} {:>12.3} {:>6.1}% {:>8.0} {:>8} {:>9} {:>7}",
                k,
                t.dispatches as f64 / passes,
                t.seconds * 1e6 / t.dispatches.max(1) as f64,
                t.seconds * 1e3 / passes,
                100.0 * t.seconds / profiled,
                groups,
                groups_cell(t.fewest_workgroups, info.compute_units),
                rate.map_or("-".into(), |r| format!("{:.2}", r / 1e9)),
                rate.zip(copy_bandwidth)
                    .map_or("-".into(), |(r, c)| format!("{:.1}%", 100.0 * r / c)),
            ));
        }
    }
    let kernel_json: Vec<Value> = kernels
        .iter()
        .map(|(k, t)| {
            json!({"kernel": k, "dispatches": t.dispatches, "seconds": t.seconds,
                   "bytes": t.bytes, "bytes_per_second": achieved(t),
                   "workgroups": t.workgroups, "fewest_workgroups": t.fewest_workgroups})
        })
        .collect();
    let per = |x: u64, n: u64| (n > 0).then(|| x as f64 / n as f64);
    let json = json!({
        "device": info.name,
        "software": info.software,
        "compute_units": info.compute_units,
        "row_threads": device.gpu().row_threads(),
        "subgroup_lanes": device.gpu().subgroup_lanes(),
        "kernels": kernel_json,
        "copy_bandwidth_bytes_per_second": copy_bandwidth,
        "passes": s.passes,
        "target_passes": s.target_passes,
        "crossings": s.crossings,
        "dispatches": s.runtime.dispatches,
        "submissions": s.runtime.submissions,
        "read_backs": s.runtime.read_backs,
        "buffers_created": s.runtime.buffers_created,
        "bind_groups_created": s.runtime.bind_groups_created,
        "dispatches_per_token": s.runtime.dispatches as f64 / tok,
        "read_back_bytes_per_token": s.read_back_bytes as f64 / tok,
        "device_ms_per_submission": gpu_ms,
        "host_cpu_ms_per_token": cpu_seconds.map(|c| c * 1e3 / tok),
        "steady_steps": steady.target_passes,
        "steady_passes": steady.passes,
        "dispatches_per_step": per(r.dispatches, steady.target_passes),
        "submissions_per_step": per(r.submissions, steady.target_passes),
        "read_backs_per_step": per(r.read_backs, steady.target_passes),
        "buffers_created_per_pass": per(r.buffers_created, steady.passes),
        "bind_groups_created_per_pass": per(r.bind_groups_created, steady.passes),
        "pipelines_created_per_pass": per(r.pipelines_created, steady.passes),
    });
    (line, json)
}

/// Which kernels run the passes: the CPU's instruction set, or the device's name.
fn kernels_label(loaded: &Loaded) -> String {
    match &loaded.model.device {
        Some(d) => format!(
            "{} device{}",
            d.gpu().info.name,
            if d.gpu().info.software {
                " (software)"
            } else {
                ""
            }
        ),
        None => format!("{} CPU", nextn_quant::kernels::kernel_isa()),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[derive(Default)]
struct RunTotals {
    prompt_n: usize,
    prompt_ms: f64,
    predicted_n: usize,
    predicted_ms: f64,
    stats: SpecStats,
    /// With a grammar: milliseconds computing its masks, and how many.
    grammar_ms: f64,
    grammar_masks: u64,
}

/// One measured configuration of the generation loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RunKind {
    policy: Policy,
    mode: DraftSampling,
    /// With a grammar: drafts are picked among the tokens it allows.
    mask_drafts: bool,
}

impl RunKind {
    fn mode_name(self) -> String {
        match (self.policy, self.mask_drafts) {
            (Policy::Plain, _) => "-".into(),
            (_, true) => self.mode.as_str().into(),
            (_, false) => format!("{}/unmasked", self.mode.as_str()),
        }
    }
}

/// What every run shares.
struct Setup<'a> {
    loaded: &'a Loaded,
    prompts: &'a [Prompt],
    n: usize,
    sampling: SamplerConfig,
    grammar: Option<GrammarSource>,
    compiler: std::cell::RefCell<Option<GrammarCompiler>>,
    /// `--force-acceptance` rates and seed.
    forced: Option<(Vec<f64>, u64)>,
}

fn sampler_config(temp: f32, seed: u64) -> SamplerConfig {
    if temp > 0.0 {
        SamplerConfig {
            temperature: temp,
            seed,
            ..Default::default()
        }
    } else {
        SamplerConfig::greedy()
    }
}

/// What a run measures: plain decoding, a fixed draft depth every step, or the adaptive policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    Plain,
    Fixed(usize),
    Auto(usize),
}

impl Policy {
    /// The list given to --spec-draft-n-max: numbers, and `auto` (with the largest number given,
    /// else 3).
    fn parse_list(values: &[String]) -> Result<Vec<Policy>> {
        let mut depths = Vec::new();
        for v in values {
            if v != "auto" {
                depths.push(v.trim().parse::<usize>().with_context(|| {
                    format!("--spec-draft-n-max {v}: expected a number of drafts or `auto`")
                })?);
            }
        }
        let auto_max = depths.iter().copied().max().filter(|&m| m > 0).unwrap_or(3);
        Ok(values
            .iter()
            .zip(0..)
            .map(|(v, _)| match v.trim() {
                "auto" => Policy::Auto(auto_max),
                n => match n.parse::<usize>() {
                    Ok(0) | Err(_) => Policy::Plain,
                    Ok(k) => Policy::Fixed(k),
                },
            })
            .collect())
    }

    fn n_max(self) -> usize {
        match self {
            Policy::Plain => 0,
            Policy::Fixed(k) | Policy::Auto(k) => k,
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Policy::Plain => "plain",
            Policy::Fixed(_) => "fixed",
            Policy::Auto(_) => "auto",
        }
    }

    fn label(self) -> String {
        match self {
            Policy::Auto(_) => "auto".into(),
            p => p.n_max().to_string(),
        }
    }
}

/// Pieces of text a request streams before its device counters count as steady state: its
/// first passes make the buffers and bind groups of its shapes.
const STEADY_AFTER_TEXTS: usize = 8;

/// The device's counters over the steady state of every request of a run: from its
/// [`STEADY_AFTER_TEXTS`]-th piece of text to its end.
#[derive(Clone, Default)]
struct Steady(Arc<Mutex<DeviceProgress>>);

/// Collects a request's end (and nothing of its text) for the bench, and on the device its
/// steady-state counters.
struct Collect {
    tx: mpsc::Sender<Event>,
    device: Option<(Arc<DeviceModel>, Steady)>,
    texts: usize,
    mark: Option<DeviceProgress>,
}

impl Collect {
    fn new(tx: mpsc::Sender<Event>, device: Option<(Arc<DeviceModel>, Steady)>) -> Self {
        Collect {
            tx,
            device,
            texts: 0,
            mark: None,
        }
    }
}

impl EventSink for Collect {
    fn send(&mut self, event: Event) -> bool {
        match event {
            Event::Text(_) => {
                self.texts += 1;
                if self.texts == STEADY_AFTER_TEXTS {
                    self.mark = self.device.as_ref().map(|(d, _)| d.progress());
                }
                true
            }
            Event::Done(_) | Event::Failed { .. } => {
                if let (Some((d, steady)), Some(mark)) = (&self.device, self.mark.take()) {
                    if let Ok(mut s) = steady.0.lock() {
                        s.add(&d.progress().since(&mark));
                    }
                }
                self.tx.send(event).is_ok()
            }
            _ => true,
        }
    }

    fn is_closed(&self) -> bool {
        false
    }
}

/// Every prompt, one after the other on one slot, through the generation loop as `kind` says.
fn run_depth(
    setup: &Setup,
    head: Option<&NextnHead>,
    kind: RunKind,
    outputs: Option<&mut Vec<Vec<u32>>>,
    plain_outputs: &[Vec<u32>],
    steady: Option<&Steady>,
) -> Result<RunTotals> {
    let loaded = setup.loaded;
    let head = head.filter(|_| kind.policy != Policy::Plain);
    let spec = SpecConfig {
        n_max: kind.policy.n_max(),
        draft_sampling: kind.mode,
        mask_drafts: kind.mask_drafts,
        ..SpecConfig::default()
    };
    let mut scheduler = Scheduler::new(
        loaded.engine(head),
        SchedulerConfig {
            n_slots: 1,
            n_ctx_slot: loaded.n_ctx,
            k_type: loaded.k_type,
            v_type: loaded.v_type,
            n_batch: 512,
            queue_capacity: setup.prompts.len(),
            spec: head.is_some().then_some(spec),
            policy: match kind.policy {
                Policy::Auto(_) => DraftPolicy::Auto,
                _ => DraftPolicy::ALWAYS,
            },
            calibrate: true,
            prefix_cache: None,
        },
    );
    let (tx, rx) = mpsc::channel();
    for (i, p) in setup.prompts.iter().enumerate() {
        let forced_acceptance = match (&setup.forced, head, plain_outputs.get(i)) {
            (Some((rates, seed)), Some(_), Some(plain)) => {
                // Each prompt its own draws: the same output positions recur in every prompt.
                let seed = seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                Some(ForcedAcceptance::new(rates, seed, plain.clone())?)
            }
            (Some(_), Some(_), None) => bail!("forced acceptance needs the plain run first"),
            _ => None,
        };
        let grammar = match &setup.grammar {
            Some(g) => Some(common::constraint(
                &mut setup.compiler.borrow_mut(),
                loaded,
                g,
            )?),
            None => None,
        };
        scheduler.submit(Request {
            prompt: p.tokens.clone(),
            sampler: setup.sampling.clone(),
            n_predict: Some(setup.n),
            stop: Vec::new(),
            // With a grammar, generation ends where the grammar does.
            ignore_eos: setup.grammar.is_none(),
            trace: false,
            grammar,
            logprobs: None,
            cache_prompt: false,
            cache_points: Vec::new(),
            forced_acceptance,
            images: Vec::new(),
            prompt_progress: false,
            sink: Box::new(Collect::new(
                tx.clone(),
                loaded.model.device.clone().zip(steady.cloned()),
            )),
        });
    }
    scheduler.run();
    let mut t = RunTotals::default();
    let mut outs = Vec::new();
    for p in setup.prompts {
        let c = match rx.try_recv() {
            Ok(Event::Done(c)) => c,
            Ok(Event::Failed { message, .. }) => bail!("prompt {}: {message}", p.name),
            _ => bail!("prompt {}: generation ended without a result", p.name),
        };
        t.prompt_n += c.timings.prompt_n;
        t.prompt_ms += c.timings.prompt_ms;
        t.predicted_n += c.timings.predicted_n;
        t.predicted_ms += c.timings.predicted_ms;
        t.stats.merge(&c.spec);
        if let Some((ms, n)) = c.grammar_masks {
            t.grammar_ms += ms;
            t.grammar_masks += n;
        }
        outs.push(c.tokens);
    }
    if let Some(o) = outputs {
        *o = outs;
    }
    Ok(t)
}

/// A model file's head quality on fixed token sequences.
struct FileCheck {
    draft_top1: f64,
    kl: f64,
    acceptance: f64,
}

impl FileCheck {
    fn json(&self) -> Value {
        json!({"draft_top1": self.draft_top1, "kl_target_head": self.kl, "acceptance": self.acceptance})
    }
}

/// DRAFT_TOP1 and KL over `sequences`, and the acceptance of the speculative loop at `depth`
/// over the setup's prompts.
fn check_file(
    setup: &Setup,
    head: &NextnHead,
    sequences: &[Vec<u32>],
    depth: usize,
) -> Result<FileCheck> {
    let (mut agree, mut rows, mut kl) = (0, 0, 0.0);
    for seq in sequences {
        let (a, r, k) = head_agreement(setup.loaded, head, seq)?;
        agree += a;
        rows += r;
        kl += k;
    }
    let kind = RunKind {
        policy: Policy::Fixed(depth),
        mode: DraftSampling::Coupled,
        mask_drafts: true,
    };
    let t = run_depth(setup, Some(head), kind, None, &[], None)?;
    Ok(FileCheck {
        draft_top1: agree as f64 / rows.max(1) as f64,
        kl: kl / rows.max(1) as f64,
        acceptance: t.stats.acceptance_rate(),
    })
}

/// Teacher-forced agreement of the head with the target over `tokens`: rows where the head's top-1
/// equals the target's top-1 (both predict the next token), and the mean KL(target ‖ head).
fn head_agreement(
    loaded: &Loaded,
    head: &NextnHead,
    tokens: &[u32],
) -> Result<(usize, usize, f64)> {
    let pool = &loaded.pool;
    let e = loaded.model.config.n_embd;
    let mut st = loaded.new_sequence()?;
    let target = loaded
        .model
        .forward(tokens, &mut st, LogitRows::All, pool)?;
    let mut prev = vec![0.0f32; e];
    prev.extend_from_slice(&target.hidden[..(tokens.len() - 1) * e]);
    let mut cache = head.new_cache(loaded.k_type, loaded.v_type, loaded.n_ctx)?;
    let drafts = head.forward(tokens, &prev, 0, &mut cache, LogitRows::All, pool)?;
    let (mut agree, mut kl) = (0, 0.0);
    // Row 0 has no real hidden state behind it; skip it.
    for p in 1..tokens.len() {
        let (t, d) = (target.logits_row(p), drafts.logits_row(p));
        if argmax(t) == argmax(d) {
            agree += 1;
        }
        kl += kl_divergence(t, d);
    }
    let rows = tokens.len() - 1;
    Ok((agree, rows, kl))
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - lse).collect()
}

fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter().zip(&lq).map(|(&a, &b)| a.exp() * (a - b)).sum()
}

/// Milliseconds of one draft step at position `pos` (token `token`, the target's hidden state
/// `h_last` of the position before); the cache is left as it was.
fn time_draft_step(
    loaded: &Loaded,
    head: &NextnHead,
    cache: &mut LayerCache,
    token: u32,
    h_last: &[f32],
    pos: usize,
) -> Result<f64> {
    let t = Instant::now();
    head.forward(&[token], h_last, pos, cache, LogitRows::Last, &loaded.pool)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    NextnHead::truncate(cache, pos);
    Ok(ms)
}

/// Expected tokens per step with n drafts when position i is accepted with (marginal) rate a_i,
/// and the speedup over plain decoding projected from the step costs (`None` without a measured
/// verify of n + 1 rows).
fn project(
    decode_ms: f64,
    verify_ms: &[f64],
    draft_ms: f64,
    acceptance: &[f64],
    n: usize,
) -> Option<(f64, f64)> {
    let verify = *verify_ms.get(n)?;
    Some(speedup_at(decode_ms, verify, draft_ms, acceptance, n))
}

/// [`project`] for one verify cost of n + 1 rows: (expected tokens per step, speedup). Rates
/// beyond the given ones repeat the last.
fn speedup_at(
    decode_ms: f64,
    verify_ms: f64,
    draft_ms: f64,
    acceptance: &[f64],
    n: usize,
) -> (f64, f64) {
    let a = |i: usize| {
        acceptance
            .get(i)
            .or(acceptance.last())
            .copied()
            .unwrap_or(0.0)
    };
    let tokens = 1.0 + (0..n).map(a).sum::<f64>();
    (
        tokens,
        tokens * decode_ms / (n as f64 * draft_ms + verify_ms),
    )
}

/// A pass-timing mode's report: on stdout as JSON when stdout carries no text report, and under
/// `key` in the --json file.
fn emit_report(
    key: &str,
    report: &Value,
    human_to_stdout: bool,
    json_path: Option<&PathBuf>,
) -> Result<()> {
    if !human_to_stdout {
        println!("{}", serde_json::to_string_pretty(report)?);
    }
    if let Some(path) = json_path {
        std::fs::write(path, serde_json::to_string_pretty(&json!({ key: report }))?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Where the text report goes: stdout, unless stdout carries the table of runs (-o md|csv|json|jsonl).
#[derive(Clone, Copy)]
struct ReportOut {
    to_stdout: bool,
}

impl ReportOut {
    fn line(self, line: impl std::fmt::Display) {
        if self.to_stdout {
            println!("{line}")
        } else {
            eprintln!("{line}")
        }
    }
}

/// One line of the text report: `say!(out)` for an empty one, `say!(out, format, args...)`.
macro_rules! say {
    ($out:expr) => {
        $out.line("")
    };
    ($out:expr, $($t:tt)*) => {
        $out.line(format_args!($($t)*))
    };
}

/// What every mode of the bench is given: the arguments, the model, its head and the prompts.
struct Bench<'a> {
    args: &'a Args,
    loaded: &'a Loaded,
    head: Option<&'a NextnHead>,
    prompts: &'a [Prompt],
    out: ReportOut,
    /// With `--device-profile`: the device's copy bandwidth (bytes a second, read plus written),
    /// the ceiling each kernel's achieved bandwidth is set against.
    copy_bandwidth: Option<f64>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let out = ReportOut {
        to_stdout: args.output == "text",
    };
    if args.repetitions == 0 {
        bail!("-r 0: at least one repetition is needed");
    }
    let mut policies = Policy::parse_list(&args.n_max)?;
    // An -hf repository's projector is looked up only to time --image encodes.
    let mmproj = if args.image.is_empty() {
        args.vision.mmproj.clone()
    } else {
        args.vision.path(&args.model)?
    };
    match (&mmproj, args.image.is_empty()) {
        (None, false) => bail!("--image times the vision tower's encodes: give --mmproj FILE"),
        (Some(p), true) => bail!(
            "--mmproj {}: bench times its encodes of the pictures given with --image FILE",
            p.display()
        ),
        _ => {}
    }
    if let (Some(mmproj), false) = (&mmproj, args.image.is_empty()) {
        let loaded = common::load(&args.model, false)?;
        return images::run(&args, &loaded, mmproj, out);
    }
    args.vision
        .flags_unused("bench loads a vision tower only to time --image encodes");
    let loaded = common::load(&args.model, policies.iter().any(|&p| p != Policy::Plain))?;
    let head = NextnHead::load(&loaded.model).ok();
    if args.device_profile {
        match loaded.model.device.as_deref() {
            None => bail!("--device-profile times kernels on a device: the model runs on the CPU here (choose one with -dev)"),
            Some(d) if !d.gpu().has_dispatch_timestamps() => eprintln!(
                "--device-profile: {} cannot write timestamps inside a pass; only pass times are reported",
                d.gpu().info.name
            ),
            Some(_) => {}
        }
    }
    // The ceiling the kernels' bandwidths are set against: a 256 MiB copy (at most the
    // device's binding limit), best of five.
    let copy_bandwidth = match loaded.model.device.as_deref() {
        Some(d) if args.device_profile => {
            let rate = nextn_gpu::kernels::elementwise::copy_bandwidth(d.gpu(), 256 << 20)
                .context("--device-profile: measuring the device's copy bandwidth")?;
            if let Some(r) = rate {
                eprintln!(
                    "device copy bandwidth: {:.1} GB/s (read plus written, 256 MiB, best of 5)",
                    r / 1e9
                );
            }
            rate
        }
        _ => None,
    };
    let prompts = read_prompts(&loaded, args.prompts.as_ref())?;
    let forced = forced_acceptance(&args, &mut policies)?;
    let want_spec = policies.iter().any(|&p| p != Policy::Plain);
    if want_spec && head.is_none() {
        bail!(
            "{} has no NextN head: only --spec-draft-n-max 0 (plain decoding) can run",
            loaded.path.display()
        );
    }
    let trimmed = match (&head, args.draft_vocab.draft_vocab) {
        (None, Some(_)) => bail!("--spec-draft-vocab needs a NextN head"),
        (Some(_), Some(_)) => {
            let mut h = NextnHead::load(&loaded.model)?;
            args.draft_vocab.apply(&loaded, &mut h)?;
            Some(h)
        }
        _ => None,
    };
    let bench = Bench {
        args: &args,
        loaded: &loaded,
        head: head.as_ref(),
        prompts: &prompts,
        out,
        copy_bandwidth,
    };
    if !args.depth.is_empty() {
        return run_depths(&bench);
    }
    if args.expert_union {
        return run_expert_union(&bench);
    }
    run_generation(&bench, &policies, forced, trimmed.as_ref())
}

/// `--force-acceptance`: its rates and seed, checked, with the plain run moved first in
/// `policies` (its output is what the drafts are forced towards).
fn forced_acceptance(args: &Args, policies: &mut Vec<Policy>) -> Result<Option<(Vec<f64>, u64)>> {
    if args.force_acceptance.is_empty() {
        return Ok(None);
    }
    if args.grammar.source()?.is_some() {
        bail!("--force-acceptance cannot be combined with a grammar: it rewrites the drafts towards the plain output, which the grammar's masks do not follow");
    }
    ForcedAcceptance::new(&args.force_acceptance, args.seed, Vec::new())
        .map_err(|e| anyhow::anyhow!("--force-acceptance: {e}"))?;
    policies.retain(|&p| p != Policy::Plain);
    policies.insert(0, Policy::Plain);
    Ok(Some((args.force_acceptance.clone(), args.seed)))
}

/// `-d N,...`: the passes of the loop timed after a prefill of each depth.
fn run_depths(b: &Bench) -> Result<ExitCode> {
    let (args, loaded) = (b.args, b.loaded);
    eprintln!(
        "bench at depth: {} threads, {} kernels, KV {}/{}, median of {} reps",
        loaded.pool.n_threads(),
        kernels_label(loaded),
        loaded.k_type.name(),
        loaded.v_type.name(),
        args.reps
    );
    let rows = depth::run(
        loaded,
        b.head,
        &b.prompts[0].tokens,
        &depth::DepthPlan {
            depths: &args.depth,
            max_rows: args.floor.verify_rows.max(2),
            reps: args.reps,
            fill_from: args.depth_fill,
        },
        &|line: String| b.out.line(line),
    )?;
    emit_report("depths", &json!(rows), b.out.to_stdout, args.json.as_ref())?;
    Ok(ExitCode::SUCCESS)
}

/// `--expert-union`: verify passes timed at every number of distinct experts their rows pick.
fn run_expert_union(b: &Bench) -> Result<ExitCode> {
    let (args, loaded) = (b.args, b.loaded);
    eprintln!(
        "bench --expert-union: {} threads, {} kernels, median of {} reps",
        loaded.pool.n_threads(),
        kernels_label(loaded),
        args.reps
    );
    let report = union::run(
        loaded,
        b.head,
        &b.prompts[0].tokens,
        args.floor.verify_rows,
        args.reps,
        &args.assume_acceptance,
        &|line: String| b.out.line(line),
    )?;
    emit_report("expert_union", &report, b.out.to_stdout, args.json.as_ref())?;
    Ok(ExitCode::SUCCESS)
}

/// The generation runs (the default mode): every policy, draft-sampling mode and draft mask
/// measured through the loop, then the cost model, its projections and the optional reports
/// (draft vocabulary, floor, --check), the --json file, the plot and the table.
fn run_generation(
    b: &Bench,
    policies: &[Policy],
    forced: Option<(Vec<f64>, u64)>,
    trimmed: Option<&NextnHead>,
) -> Result<ExitCode> {
    let (args, loaded, prompts) = (b.args, b.loaded, b.prompts);
    let max_n = policies.iter().map(|p| p.n_max()).max().unwrap_or(0);
    eprintln!(
        "bench: {} prompts × {} tokens, {} threads, {} kernels, draft depths {}",
        prompts.len(),
        args.n_predict,
        loaded.pool.n_threads(),
        kernels_label(loaded),
        args.n_max.join(",")
    );
    let setup = Setup {
        loaded,
        prompts,
        n: args.n_predict,
        sampling: sampler_config(args.temp, args.seed),
        grammar: args.grammar.source()?,
        compiler: std::cell::RefCell::new(None),
        forced: forced.clone(),
    };
    let runs = run_kinds(b, policies, &setup);
    let measured = measure_runs(b, &setup, &runs)?;
    let (grammar_ms, grammar_masks, generated) = measured.grammar_time;
    if setup.grammar.is_some() && generated > 0 {
        say!(
            b.out,
            "grammar masks: {:.3} ms per generated token ({} masks, {:.3} ms per mask)",
            grammar_ms / generated as f64,
            grammar_masks,
            grammar_ms / grammar_masks.max(1) as f64
        );
    }

    let mut at = depth::prefill(loaded, b.head, &prompts[0].tokens)?;
    let costs = depth::time_passes(
        loaded,
        b.head,
        &mut at,
        &prompts[0].tokens,
        max_n.max(1) + 1,
        args.reps,
    )?;
    say_costs(b, &costs);
    // Forced runs are projected at the rates they were forced to, for a like-for-like comparison.
    let assumed = forced
        .as_ref()
        .map_or(args.assume_acceptance.clone(), |(r, _)| r.clone());
    let projections = if b.head.is_some() {
        project_speedups(b, &measured, &costs, &assumed, max_n, forced.is_some())
    } else {
        Vec::new()
    };
    let draft_vocab_report = match trimmed.filter(|_| !costs.draft_ms.is_nan()) {
        Some(trimmed) => {
            draft_vocab_report(b, &setup, &measured, trimmed, &costs, &assumed, max_n)?
        }
        None => Value::Null,
    };
    let floor_report = if args.floor.floor {
        floor::report(
            loaded,
            b.head,
            &prompts[0].tokens,
            costs.verify_ms.len(),
            args.reps,
            &args.floor,
        )?
    } else {
        Value::Null
    };
    let peak_rss = peak_rss_bytes();
    if let Some(bytes) = peak_rss {
        say!(b.out);
        say!(
            b.out,
            "peak RSS {:.1} MiB (model file {:.1} MiB, mapped; {:.1} MiB of it repacked for the kernels)",
            bytes as f64 / (1 << 20) as f64,
            loaded.file_bytes as f64 / (1 << 20) as f64,
            nextn_quant::kernels::repacked_bytes() as f64 / (1 << 20) as f64
        );
    }
    let check = if args.check {
        check_report(b, &setup, &measured, policies)?
    } else {
        Value::Null
    };

    if let Some(path) = &args.json {
        let report = json!({
            "check": check,
            "peak_rss_bytes": peak_rss,
            "repacked_bytes": nextn_quant::kernels::repacked_bytes(),
            "model_file_bytes": loaded.file_bytes,
            "model": loaded.path.display().to_string(),
            "threads": loaded.pool.n_threads(),
            "kernels": nextn_quant::kernels::kernel_isa(),
            "device": loaded.model.device.as_ref().map(|d| d.gpu().info.to_string()),
            "n_predict": args.n_predict,
            "prompts": prompts.iter().map(|p| json!({"name": p.name, "n_tokens": p.tokens.len()})).collect::<Vec<_>>(),
            "runs": measured.rows,
            "costs": {
                "decode_ms": costs.decode_ms,
                "verify_ms": costs.verify_ms,
                "draft_ms": if costs.draft_ms.is_nan() { Value::Null } else { json!(costs.draft_ms) },
            },
            "assume_acceptance": assumed,
            "forced_acceptance": forced.as_ref().map(|(r, _)| r.clone()),
            "projections": projections,
            "floor": floor_report,
            "draft_vocab": draft_vocab_report,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        plot::plot(path, &measured.table)?;
        eprintln!("plot: {}", path.display());
    }
    if !b.out.to_stdout {
        print!("{}", write_table(&args.output, &measured.table));
    }
    Ok(ExitCode::SUCCESS)
}

/// Every configuration to measure, in order: plain once, every other policy in each
/// draft-sampling mode and draft mask.
fn run_kinds(b: &Bench, policies: &[Policy], setup: &Setup) -> Vec<RunKind> {
    // Forced acceptance steers coupled drafts only.
    let modes: Vec<DraftSampling> = if b.args.temp > 0.0 && setup.forced.is_none() {
        vec![DraftSampling::Coupled, DraftSampling::Sample]
    } else {
        vec![DraftSampling::Coupled]
    };
    let masks: Vec<bool> = if setup.grammar.is_some() {
        b.args.draft_mask.iter().map(|m| m == "on").collect()
    } else {
        vec![true]
    };
    let mut runs = Vec::new();
    for &policy in policies {
        if policy == Policy::Plain {
            runs.push(RunKind {
                policy,
                mode: DraftSampling::Coupled,
                mask_drafts: true,
            });
            continue;
        }
        for &mode in &modes {
            for &mask_drafts in &masks {
                runs.push(RunKind {
                    policy,
                    mode,
                    mask_drafts,
                });
            }
        }
    }
    runs
}

/// What the generation runs measured, for the reports after them.
#[derive(Default)]
struct Measured {
    /// One JSON object per configuration (the --json file's `runs`).
    rows: Vec<Value>,
    table: Vec<TableRow>,
    /// Each configuration's statistics and decode tokens/s.
    full_runs: Vec<(RunKind, SpecStats, f64)>,
    /// Plain decoding's tokens, per prompt.
    plain_outputs: Vec<Vec<u32>>,
    plain_tps: Option<f64>,
    /// Plain decoding's tokens/s, per repetition.
    plain_reps: Vec<f64>,
    /// Tokens of coupled speculative runs equal to plain decoding's, of all compared.
    spec_agree: (usize, usize),
    /// With a grammar: milliseconds computing masks, masks and generated tokens, over all runs.
    grammar_time: (f64, u64, usize),
}

/// One configuration's repetitions.
struct KindRuns {
    totals: RunTotals,
    /// The first repetition's tokens, per prompt.
    outputs: Vec<Vec<u32>>,
    decode_reps: Vec<f64>,
    prefill_reps: Vec<f64>,
    /// On a device: its report line and JSON.
    device_cost: Option<(String, Value)>,
}

/// Every configuration in `runs`, each `-r` times, with a table line as each finishes.
fn measure_runs(b: &Bench, setup: &Setup, runs: &[RunKind]) -> Result<Measured> {
    say!(
        b.out,
        "{:>5} {:>16} | {:>10} | {:>10} | {:>7} | {:>6} | {:>6} | {:>8} | {:>8} | per-position acceptance",
        "n_max", "drafts", "prefill/s", "decode/s", "speedup", "accept", "len", "draft ms", "verify ms"
    );
    let n_runs = runs.len() * b.args.repetitions;
    let mut run_no = 0;
    let mut m = Measured::default();
    for &kind in runs {
        let r = measure_kind(b, setup, kind, &m.plain_outputs, &mut run_no, n_runs)?;
        record_kind(b, &mut m, kind, r);
    }
    Ok(m)
}

/// The repetitions of one configuration, each on a fresh loop; the statistics add up over them.
fn measure_kind(
    b: &Bench,
    setup: &Setup,
    kind: RunKind,
    plain_outputs: &[Vec<u32>],
    run_no: &mut usize,
    n_runs: usize,
) -> Result<KindRuns> {
    let mut outputs = Vec::new();
    let mut decode_reps = Vec::new();
    let mut prefill_reps = Vec::new();
    let mut t = RunTotals::default();
    let device = b.loaded.model.device.as_deref();
    if let Some(d) = device {
        d.set_timing(true);
        d.set_profiling(b.args.device_profile);
        d.take_stats();
    }
    let steady = Steady::default();
    let cpu_before = process_cpu_seconds();
    for rep in 0..b.args.repetitions {
        *run_no += 1;
        let started = Instant::now();
        let r = run_depth(
            setup,
            b.head,
            kind,
            (rep == 0).then_some(&mut outputs),
            plain_outputs,
            Some(&steady),
        )?;
        let d = r.predicted_n as f64 * 1e3 / r.predicted_ms.max(1e-9);
        let p = r.prompt_n as f64 * 1e3 / r.prompt_ms.max(1e-9);
        eprintln!(
            "[{run_no}/{n_runs}] n_max {} {}: {d:.1} tok/s decode, {p:.1} tok/s prefill ({:.1} s)",
            kind.policy.label(),
            kind.mode_name(),
            started.elapsed().as_secs_f64()
        );
        decode_reps.push(d);
        prefill_reps.push(p);
        t.prompt_n += r.prompt_n;
        t.prompt_ms += r.prompt_ms;
        t.predicted_n += r.predicted_n;
        t.predicted_ms += r.predicted_ms;
        t.stats.merge(&r.stats);
        t.grammar_ms += r.grammar_ms;
        t.grammar_masks += r.grammar_masks;
    }
    let device_cost = device.map(|d| {
        let cpu = process_cpu_seconds()
            .zip(cpu_before)
            .map(|(after, before)| after - before);
        let steady = steady.0.lock().map(|s| *s).unwrap_or_default();
        device_report(
            d,
            t.prompt_n + t.predicted_n,
            cpu,
            &steady,
            b.copy_bandwidth,
        )
    });
    if let Some((line, _)) = &device_cost {
        eprintln!("{line}");
    }
    Ok(KindRuns {
        totals: t,
        outputs,
        decode_reps,
        prefill_reps,
        device_cost,
    })
}

/// One configuration's results into `m`: plain decoding's output and speed (what later runs are
/// compared with), the agreement of coupled runs with it, its table line, table row and JSON.
fn record_kind(b: &Bench, m: &mut Measured, kind: RunKind, r: KindRuns) {
    let args = b.args;
    let (policy, mode) = (kind.policy, kind.mode);
    let k = policy.n_max();
    let t = r.totals;
    let (decode_mean, decode_sd) = mean_sd(&r.decode_reps);
    let (prefill_mean, prefill_sd) = mean_sd(&r.prefill_reps);
    m.grammar_time.0 += t.grammar_ms;
    m.grammar_time.1 += t.grammar_masks;
    m.grammar_time.2 += t.predicted_n;
    if k == 0 {
        m.plain_outputs = r.outputs;
    } else if mode == DraftSampling::Coupled && !m.plain_outputs.is_empty() {
        // Greedy, or coupled sampling: the very tokens plain decoding gives.
        for (ours, plain) in r.outputs.iter().zip(&m.plain_outputs) {
            m.spec_agree.0 += ours.iter().zip(plain).filter(|(x, y)| x == y).count();
            m.spec_agree.1 += plain.len();
        }
    }
    let prefill = t.prompt_n as f64 * 1e3 / t.prompt_ms.max(1e-9);
    let decode = t.predicted_n as f64 * 1e3 / t.predicted_ms.max(1e-9);
    if k == 0 {
        m.plain_tps = Some(decode);
        m.plain_reps = r.decode_reps.clone();
    }
    let speedup = m.plain_tps.map(|p| decode / p);
    // Speedup per repetition against plain decoding's mean, for its spread.
    let speedup_sd = m
        .plain_tps
        .filter(|_| !m.plain_reps.is_empty())
        .map(|p| mean_sd(&r.decode_reps.iter().map(|d| d / p).collect::<Vec<_>>()).1);
    let per_pos: Vec<f64> = t
        .stats
        .accepted_per_pos
        .iter()
        .zip(&t.stats.drafted_per_pos)
        .map(|(&a, &d)| if d > 0 { a as f64 / d as f64 } else { 0.0 })
        .collect();
    let mode_name = kind.mode_name();
    let with_sd = |mean: f64, sd: f64| {
        if args.repetitions > 1 {
            format!("{mean:.1}±{sd:.1}")
        } else {
            format!("{mean:.1}")
        }
    };
    say!(
        b.out,
        "{:>5} {:>16} | {:>10} | {:>10} | {:>7} | {:>6} | {:>6.3} | {:>8.1} | {:>8.1} | {}",
        policy.label(),
        mode_name,
        with_sd(prefill_mean, prefill_sd),
        with_sd(decode_mean, decode_sd),
        speedup
            .map(|s| format!("{s:.3}x"))
            .unwrap_or_else(|| "-".into()),
        if k > 0 {
            format!("{:.3}", t.stats.acceptance_rate())
        } else {
            "-".into()
        },
        t.stats.mean_accepted_len(),
        t.stats.draft_ms,
        t.stats.verify_ms,
        per_pos
            .iter()
            .map(|p| format!("{p:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    m.table.push(TableRow {
        n_max: policy.label(),
        drafts: mode_name.clone(),
        prefill: (prefill_mean, prefill_sd),
        decode: (decode_mean, decode_sd),
        speedup: speedup.map(|s| (s, speedup_sd.unwrap_or(0.0))),
        acceptance: (k > 0).then(|| t.stats.acceptance_rate()),
        mean_len: t.stats.mean_accepted_len(),
        per_position: per_pos.clone(),
    });
    m.rows.push(json!({
        "device": r.device_cost.as_ref().map(|(_, j)| j.clone()),
        "n_max": k,
        "policy": policy.kind(),
        "draft_sampling": if k == 0 { "-" } else { mode.as_str() },
        "mask_drafts": kind.mask_drafts,
        "temperature": args.temp,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prefill_tok_s": prefill,
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "decode_tok_s": decode,
        "decode_tok_s_mean": decode_mean,
        "decode_tok_s_sd": decode_sd,
        "prefill_tok_s_sd": prefill_sd,
        "repetitions": args.repetitions,
        "speedup_vs_plain": speedup,
        "spec": if k > 0 { t.stats.to_json(t.predicted_n) } else { Value::Null },
        "grammar_ms": t.grammar_ms,
        "grammar_masks": t.grammar_masks,
    }));
    m.full_runs.push((kind, t.stats, decode));
}

/// The cost model's lines: decode step, verify of 1.. rows, draft step.
fn say_costs(b: &Bench, costs: &depth::Costs) {
    say!(b.out);
    say!(
        b.out,
        "cost model (median of {} reps, context {} tokens):",
        b.args.reps,
        b.prompts[0].tokens.len()
    );
    say!(
        b.out,
        "  plain decode step        {:8.3} ms",
        costs.decode_ms
    );
    for (i, v) in costs.verify_ms.iter().enumerate() {
        say!(
            b.out,
            "  verify {} row{}            {:8.3} ms  ({:.2}x decode)",
            i + 1,
            if i == 0 { " " } else { "s" },
            v,
            v / costs.decode_ms
        );
    }
    if b.head.is_some() {
        say!(
            b.out,
            "  draft step (full vocab)  {:8.3} ms  ({:.2}x decode)",
            costs.draft_ms,
            costs.draft_ms / costs.decode_ms
        );
    }
}

/// The speedup the costs project at acceptance `assumed` for each depth up to `max_n`, next to
/// the forced run at that depth when there is one.
fn project_speedups(
    b: &Bench,
    m: &Measured,
    costs: &depth::Costs,
    assumed: &[f64],
    max_n: usize,
    forced: bool,
) -> Vec<Value> {
    say!(b.out, "projected speedup at acceptance {assumed:?}:");
    let mut projections = Vec::new();
    for n in 1..=max_n.max(1) {
        let Some((tokens, speedup)) = project(
            costs.decode_ms,
            &costs.verify_ms,
            costs.draft_ms,
            assumed,
            n,
        ) else {
            break;
        };
        // The forced run at this depth, measured in the same process.
        let measured = m.plain_tps.filter(|_| forced).and_then(|plain| {
            m.full_runs
                .iter()
                .find(|(k, _, _)| k.policy == Policy::Fixed(n))
                .map(|(_, stats, d)| (d / plain, stats.mean_accepted_len()))
        });
        match measured {
            Some((ms, len)) => say!(
                b.out,
                "  n_max {n}: {tokens:.2} tokens/step, {speedup:.3}x projected; measured {ms:.3}x at {len:.2} tokens/step"
            ),
            None => say!(b.out, "  n_max {n}: {tokens:.2} tokens/step, {speedup:.3}x"),
        }
        projections.push(json!({
            "n_max": n,
            "tokens_per_step": tokens,
            "speedup": speedup,
            "measured_speedup": measured.map(|m| m.0),
            "measured_tokens_per_step": measured.map(|m| m.1),
        }));
    }
    projections
}

/// `--spec-draft-vocab`: the trimmed head's draft step and the acceptance it keeps.
fn draft_vocab_report(
    b: &Bench,
    setup: &Setup,
    m: &Measured,
    trimmed: &NextnHead,
    costs: &depth::Costs,
    assumed: &[f64],
    max_n: usize,
) -> Result<Value> {
    let cost = draft_vocab::costs(
        b.loaded,
        trimmed,
        &b.prompts[0].tokens,
        b.args.reps,
        costs.decode_ms,
        &costs.verify_ms,
        costs.draft_ms,
        assumed,
        max_n,
    )?;
    let accept = draft_vocab::acceptance(trimmed, &m.full_runs, m.plain_tps, |h, kind| {
        let t = run_depth(setup, Some(h), kind, None, &m.plain_outputs, None)?;
        Ok((
            t.stats,
            t.predicted_n as f64 * 1e3 / t.predicted_ms.max(1e-9),
        ))
    })?;
    Ok(json!({"costs": cost, "acceptance": accept}))
}

/// Each prompt followed by plain decoding's output for it.
fn checked_sequences(prompts: &[Prompt], plain_outputs: &[Vec<u32>]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut seq = p.tokens.clone();
            if let Some(out) = plain_outputs.get(i) {
                seq.extend_from_slice(out);
            }
            seq
        })
        .collect()
}

/// `--check`: SPEC_AGREE, DRAFT_TOP1 and KL, and with --check-against the same for another file.
fn check_report(b: &Bench, setup: &Setup, m: &Measured, policies: &[Policy]) -> Result<Value> {
    let Some(head) = b.head else {
        bail!("--check needs a NextN head")
    };
    let sequences = checked_sequences(b.prompts, &m.plain_outputs);
    let (mut agree, mut rows_n, mut kl) = (0, 0, 0.0);
    for seq in &sequences {
        let (a, r, k) = head_agreement(b.loaded, head, seq)?;
        agree += a;
        rows_n += r;
        kl += k;
    }
    let spec_agree = if m.spec_agree.1 > 0 {
        Some(m.spec_agree.0 as f64 / m.spec_agree.1 as f64)
    } else {
        None
    };
    say!(b.out);
    say!(
        b.out,
        "check over {} prompts ({} teacher-forced rows):",
        b.prompts.len(),
        rows_n
    );
    match spec_agree {
        Some(v) => say!(b.out, "  SPEC_AGREE  {v:.4}  (MTP tokens equal to plain decoding's: greedy, or coupled sampling with the same seed)"),
        None => say!(b.out, "  SPEC_AGREE  -       (needs n_max 0 plus a depth > 0)"),
    }
    say!(
        b.out,
        "  DRAFT_TOP1  {:.4}  (head top-1 equals the target's top-1)",
        agree as f64 / rows_n.max(1) as f64
    );
    say!(
        b.out,
        "  KL          {:.4}  (mean KL(target ‖ head), nats)",
        kl / rows_n.max(1) as f64
    );
    let mut check = json!({
        "spec_agree": spec_agree,
        "draft_top1": agree as f64 / rows_n.max(1) as f64,
        "kl_target_head": kl / rows_n.max(1) as f64,
        "rows": rows_n,
    });
    if let Some(other_path) = &b.args.check_against {
        let against = check_against(b, setup, head, &sequences, policies, other_path)?;
        if let Some(c) = check.as_object_mut() {
            c.insert("against".into(), against);
        }
    }
    Ok(check)
}

/// `--check-against FILE`: both files on the same token sequences (this model's prompts and plain
/// outputs) and the same draft depth, so the numbers differ only by the files' weights.
fn check_against(
    b: &Bench,
    setup: &Setup,
    head: &NextnHead,
    sequences: &[Vec<u32>],
    policies: &[Policy],
    other_path: &std::path::Path,
) -> Result<Value> {
    let args = b.args;
    let depth = policies
        .iter()
        .map(|p| p.n_max())
        .max()
        .filter(|&k| k > 0)
        .unwrap_or(3);
    let ours = check_file(setup, head, sequences, depth)?;
    let other_args = common::ModelArgs {
        model: Some(other_path.to_path_buf()),
        ..args.model.clone()
    };
    let other = common::load(&other_args, true)
        .with_context(|| format!("--check-against {}", other_path.display()))?;
    if other.model.n_vocab != b.loaded.model.n_vocab {
        bail!(
            "--check-against {}: its vocabulary has {} tokens, this model's {}: not the same model",
            other_path.display(),
            other.model.n_vocab,
            b.loaded.model.n_vocab
        );
    }
    let other_head = NextnHead::load(&other.model)
        .with_context(|| format!("--check-against {}: no NextN head", other_path.display()))?;
    let other_setup = Setup {
        loaded: &other,
        prompts: b.prompts,
        n: args.n_predict,
        sampling: sampler_config(args.temp, args.seed),
        grammar: None,
        compiler: std::cell::RefCell::new(None),
        forced: None,
    };
    let theirs = check_file(&other_setup, &other_head, sequences, depth)?;
    say!(b.out);
    say!(
        b.out,
        "check against {} (same sequences, n_max {depth}):",
        other_path.display()
    );
    say!(b.out, "              {:>10} {:>10}", "this", "other");
    say!(
        b.out,
        "  DRAFT_TOP1  {:>10.4} {:>10.4}",
        ours.draft_top1,
        theirs.draft_top1
    );
    say!(b.out, "  KL          {:>10.4} {:>10.4}", ours.kl, theirs.kl);
    say!(
        b.out,
        "  acceptance  {:>10.4} {:>10.4}",
        ours.acceptance,
        theirs.acceptance
    );
    Ok(json!({
        "file": other_path.display().to_string(),
        "n_max": depth,
        "this": ours.json(),
        "other": theirs.json(),
    }))
}

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// One configuration's line of the -o table.
struct TableRow {
    n_max: String,
    drafts: String,
    prefill: (f64, f64),
    decode: (f64, f64),
    speedup: Option<(f64, f64)>,
    acceptance: Option<f64>,
    mean_len: f64,
    per_position: Vec<f64>,
}

impl TableRow {
    fn json(&self) -> Value {
        json!({
            "n_max": self.n_max,
            "drafts": self.drafts,
            "prefill_tok_s": self.prefill.0,
            "prefill_tok_s_sd": self.prefill.1,
            "decode_tok_s": self.decode.0,
            "decode_tok_s_sd": self.decode.1,
            "speedup": self.speedup.map(|s| s.0),
            "speedup_sd": self.speedup.map(|s| s.1),
            "acceptance": self.acceptance,
            "mean_len": self.mean_len,
            "acceptance_per_position": self.per_position,
        })
    }
}

/// The runs as a markdown table, CSV, a JSON array or JSON lines.
fn write_table(format: &str, rows: &[TableRow]) -> String {
    let pm = |(m, sd): (f64, f64)| format!("{m:.2} ± {sd:.2}");
    let mut out = String::new();
    match format {
        "md" => {
            out.push_str("| n_max | drafts | prefill t/s | decode t/s | speedup | acceptance | mean len | acceptance per position |\n");
            out.push_str("|---:|---|---:|---:|---:|---:|---:|---|\n");
            for r in rows {
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {:.3} | {} |\n",
                    r.n_max,
                    r.drafts,
                    pm(r.prefill),
                    pm(r.decode),
                    r.speedup
                        .map(|(m, sd)| format!("{m:.3} ± {sd:.3}"))
                        .unwrap_or_else(|| "-".into()),
                    r.acceptance
                        .map(|a| format!("{a:.3}"))
                        .unwrap_or_else(|| "-".into()),
                    r.mean_len,
                    r.per_position
                        .iter()
                        .map(|p| format!("{p:.2}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                ));
            }
        }
        "csv" => {
            out.push_str("n_max,drafts,prefill_tok_s,prefill_tok_s_sd,decode_tok_s,decode_tok_s_sd,speedup,speedup_sd,acceptance,mean_len,acceptance_per_position\n");
            for r in rows {
                out.push_str(&format!(
                    "{},{},{:.3},{:.3},{:.3},{:.3},{},{},{},{:.4},\"{}\"\n",
                    r.n_max,
                    r.drafts,
                    r.prefill.0,
                    r.prefill.1,
                    r.decode.0,
                    r.decode.1,
                    r.speedup.map(|s| format!("{:.4}", s.0)).unwrap_or_default(),
                    r.speedup.map(|s| format!("{:.4}", s.1)).unwrap_or_default(),
                    r.acceptance.map(|a| format!("{a:.4}")).unwrap_or_default(),
                    r.mean_len,
                    r.per_position
                        .iter()
                        .map(|p| format!("{p:.4}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                ));
            }
        }
        "json" => {
            let v: Vec<Value> = rows.iter().map(TableRow::json).collect();
            out.push_str(&serde_json::to_string_pretty(&v).unwrap_or_default());
            out.push('\n');
        }
        "jsonl" => {
            for r in rows {
                out.push_str(&r.json().to_string());
                out.push('\n');
            }
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::groups_cell;

    #[test]
    fn kernels_that_leave_compute_units_idle_are_marked() {
        assert_eq!(groups_cell(25, Some(132)), "25*");
        assert_eq!(groups_cell(132, Some(132)), "132");
        assert_eq!(groups_cell(1024, Some(132)), "1024");
        // Where the driver does not say, nothing is marked.
        assert_eq!(groups_cell(3, None), "3");
    }
}
