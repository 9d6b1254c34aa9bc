//! `nextn bench --mmproj FILE --image FILE...`: the vision tower's encode of each picture,
//! timed where `run` and `serve` place the tower, with what one encode costs the host on a
//! device (dispatches, submissions, waits).

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::{emit_report, median, Args, ReportOut};
use crate::cmd::common::Loaded;

pub(super) fn run(args: &Args, loaded: &Loaded, mmproj: &Path, out: ReportOut) -> Result<ExitCode> {
    let mut tower = args.vision.load(mmproj, &loaded.model)?;
    args.vision.place(&mut tower, loaded);
    let gpu = loaded
        .model
        .device
        .as_ref()
        .filter(|_| tower.on_device())
        .map(|d| d.gpu().clone());
    let place = match &gpu {
        Some(g) if g.info.software => format!(
            "{} (a software device: its timings are not a GPU's)",
            g.info.name
        ),
        Some(g) => g.info.name.clone(),
        None => format!("the CPU, {} threads", loaded.pool.n_threads()),
    };
    let reps = args.repetitions;
    out.line(format!(
        "vision tower {}: {} blocks of width {}, on {place}; {reps} encode(s) a picture after one \
         that warms up",
        mmproj.display(),
        tower.config().n_layer,
        tower.config().n_embd,
    ));
    let mut rows: Vec<Value> = Vec::new();
    for path in &args.image {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).with_context(|| format!("--image {shown}"))?;
        let img = nextn_vision::decode_image(&bytes, &shown)?;
        let prepared = tower.prepare(&img);
        let t = Instant::now();
        let first = tower
            .encode(&prepared, &loaded.pool)
            .with_context(|| format!("encoding {shown}"))?;
        let warm_ms = t.elapsed().as_secs_f64() * 1e3;
        let before = gpu.as_ref().map(|g| g.counters());
        let mut ms = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            tower
                .encode(&prepared, &loaded.pool)
                .with_context(|| format!("encoding {shown}"))?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let per_encode = match (&gpu, before) {
            (Some(g), Some(b)) => {
                let c = g.counters().since(&b);
                let each = |v: u64| v as f64 / reps as f64;
                Some(json!({
                    "dispatches": each(c.dispatches),
                    "submissions": each(c.submissions),
                    "waits": each(c.read_backs),
                    "buffers_created": each(c.buffers_created),
                    "bind_groups_created": each(c.bind_groups_created),
                }))
            }
            _ => None,
        };
        let tokens = first.n_tokens();
        let patches = tokens * tower.config().n_merge * tower.config().n_merge;
        let mid = median(ms.clone());
        let (lo, hi) = ms
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let mut line = format!(
            "{shown}: {}x{} tokens ({patches} patches): {mid:.1} ms median (min {lo:.1}, max \
             {hi:.1}; first {warm_ms:.1}), {:.0} patches/s",
            first.nx,
            first.ny,
            patches as f64 / (mid / 1e3)
        );
        if let Some(c) = &per_encode {
            line += &format!(
                "; per encode {} dispatches, {} submissions, {} waits, {} buffers created",
                c["dispatches"], c["submissions"], c["waits"], c["buffers_created"]
            );
        }
        out.line(line);
        rows.push(json!({
            "image": shown,
            "grid": [first.nx, first.ny],
            "tokens": tokens,
            "patches": patches,
            "placement": if gpu.is_some() { "device" } else { "cpu" },
            "device": gpu.as_ref().map(|g| g.info.name.clone()),
            "software_device": gpu.as_ref().map(|g| g.info.software),
            "threads": loaded.pool.n_threads(),
            "first_ms": warm_ms,
            "ms": ms,
            "median_ms": mid,
            "patches_per_second": patches as f64 / (mid / 1e3),
            "per_encode": per_encode,
        }));
    }
    emit_report(
        "images",
        &Value::Array(rows),
        out.to_stdout,
        args.json.as_ref(),
    )?;
    Ok(ExitCode::SUCCESS)
}
