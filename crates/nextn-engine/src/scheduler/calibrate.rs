//! Start-up measurement of what a target pass and a head pass cost at several row counts, so the
//! first drafting decisions are already priced with this machine's numbers. Bounded in time:
//! on a large model only the smallest row counts are measured and the rest is extrapolated.
//! Row counts are measured in interleaved rounds and the median of each is kept: a burst of other
//! work hits every row count alike, and the typical cost of a pass on a busy machine (where
//! waiting for a descheduled worker can dominate) is what serving will see.

use std::time::{Duration, Instant};

use nextn_model::LogitRows;

use super::core::Core;
use super::cost::RowCost;
use super::policy::DraftPolicy;
use crate::output::ms_since;

const ROW_GRID: [usize; 16] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256];
const BUDGET: Duration = Duration::from_secs(4);
const ROUNDS: usize = 5;

/// Median (no-logits, all-logits) time of each row count over interleaved rounds; stops after
/// `budget` (keeping what was measured) or at the first failure.
fn sweep(
    rows: &[usize],
    budget: Duration,
    measure: impl Fn(usize, LogitRows) -> Option<f64>,
) -> (Vec<(usize, f64)>, f64) {
    let t0 = Instant::now();
    let mut times: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); rows.len()];
    'rounds: for _ in 0..ROUNDS {
        for (i, &r) in rows.iter().enumerate() {
            let (Some(none), Some(all)) = (measure(r, LogitRows::None), measure(r, LogitRows::All))
            else {
                break 'rounds;
            };
            times[i].0.push(none);
            times[i].1.push(all);
            if t0.elapsed() > budget {
                break 'rounds;
            }
        }
    }
    let measured: Vec<(usize, f64, f64)> = rows
        .iter()
        .zip(times)
        .filter(|(_, t)| !t.0.is_empty())
        .map(|(&r, (none, all))| (r, median(none), median(all)))
        .collect();
    let points = measured.iter().map(|&(r, none, _)| (r, none)).collect();
    let logit = median(
        measured
            .iter()
            .map(|&(r, none, all)| ((all - none) / r as f64).max(0.0))
            .collect(),
    );
    (points, logit)
}

impl<'e> Core<'e> {
    pub(super) fn wants_calibration(&self) -> bool {
        self.cfg.calibrate && self.spec.is_some() && self.cfg.policy == DraftPolicy::Auto
    }

    /// Measure the cost curves; returns a one-line summary.
    pub(super) fn calibrate(&mut self) -> String {
        let t0 = Instant::now();
        let model = self.engine.model;
        let pool = self.engine.pool;
        let n_max = self.spec.as_ref().map_or(0, |s| s.n_max);
        let max_rows = (self.cfg.n_slots * (1 + n_max)).clamp(2, 256);
        let token = |i: usize| (i * 7919 % model.n_vocab.max(1)) as u32;
        let (kt, vt) = (self.cfg.k_type, self.cfg.v_type);

        let time_target = |rows: usize, logits: LogitRows| -> Option<f64> {
            let tokens: Vec<u32> = (0..rows).map(token).collect();
            let mut state = model.new_sequence(rows + 1, kt, vt).ok()?;
            let t = Instant::now();
            model.forward(&tokens, &mut state, logits, pool).ok()?;
            Some(ms_since(t))
        };
        // The first pass also pages the weights in; it is not a measurement.
        let _ = time_target(1, LogitRows::Last);
        let grid: Vec<usize> = ROW_GRID
            .iter()
            .copied()
            .filter(|&r| r <= max_rows)
            .collect();
        let (points, logit_ms) = sweep(&grid, BUDGET / 2, time_target);
        if !points.is_empty() {
            self.cost.target = RowCost::from_points(&points, logit_ms);
        }

        if let Some(head) = self.engine.head {
            let e = model.config.n_embd;
            let max_head_rows = (self.cfg.n_slots * 2).clamp(2, 256);
            let time_head = |rows: usize, logits: LogitRows| -> Option<f64> {
                let tokens: Vec<u32> = (0..rows).map(token).collect();
                let hidden = vec![0.0f32; rows * e];
                let mut cache = head.new_cache(kt, vt, rows + 1).ok()?;
                let t = Instant::now();
                head.forward(&tokens, &hidden, 0, &mut cache, logits, pool)
                    .ok()?;
                Some(ms_since(t))
            };
            let grid: Vec<usize> = ROW_GRID
                .iter()
                .copied()
                .filter(|&r| r <= max_head_rows)
                .collect();
            let left = BUDGET.saturating_sub(t0.elapsed()).max(BUDGET / 8);
            let (points, logit_ms) = sweep(&grid, left, time_head);
            if !points.is_empty() {
                self.cost.head = RowCost::from_points(&points, logit_ms);
            }

            // Committing a verify batch that kept one row (the costliest rollback: a replay).
            if n_max > 0 {
                let mut best = f64::INFINITY;
                for _ in 0..ROUNDS {
                    let Ok(mut state) = model.new_sequence(n_max + 8, kt, vt) else {
                        break;
                    };
                    let rows: Vec<u32> = (0..=n_max).map(token).collect();
                    if model.forward_verify(&rows, &mut state, pool).is_err() {
                        break;
                    }
                    let t = Instant::now();
                    if model.commit(&mut state, 1).is_err() {
                        break;
                    }
                    best = best.min(ms_since(t));
                }
                if best.is_finite() {
                    self.cost.commit_ms = best;
                }
            }
        }
        let c = &self.cost;
        format!(
            "step costs measured in {:.0} ms: target pass 1 row {:.2} ms, {} rows {:.2} ms, logits {:.3} ms/row; head pass 1 row {:.2} ms; commit {:.3} ms",
            ms_since(t0),
            c.target.pass_ms(1, 1),
            max_rows,
            c.target.pass_ms(max_rows, 1),
            c.target.logit_row_ms(),
            c.head.pass_ms(1, 1),
            c.commit_ms
        )
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
