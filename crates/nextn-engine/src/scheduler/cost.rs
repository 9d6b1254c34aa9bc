//! Measured step costs: how long a target forward (or a head pass) takes as a function of the rows
//! in it. Seeded by a short calibration at start-up and refined online from every step the
//! scheduler runs, so the drafting policy prices rows with this machine's real numbers.
//!
//! A curve is kept as a *shape* (milliseconds per row count, at calibration-time speed) times a
//! *load scale* that follows every observation quickly. On a shared machine everything slows down
//! and speeds up together; the scale absorbs that, while the shape only learns how row counts
//! compare with each other — from steps close in time — so a busy minute spent at one row count
//! does not make that row count look dear forever. Decisions compare costs with each other, so the
//! scale mostly cancels out of them.

/// Grid of row counts at which the shape is kept; between points it is linear.
const GRID: [usize; 26] = [
    1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512,
    768, 1024,
];

/// Share of an observation's residual that moves the shape (an exponential moving average).
const SHAPE_RATE: f64 = 0.03;
/// Share of an observation's ratio to the shape that moves the load scale.
const SCALE_RATE: f64 = 0.3;
/// Moving-average rate of the per-slot and commit costs.
const EXTRA_RATE: f64 = 0.1;

/// Milliseconds of one pass as a piecewise-linear function of its row count.
#[derive(Clone, Debug)]
pub struct RowCost {
    shape: Vec<f64>,
    /// Observations that moved each grid point (interpolation weights summed).
    seen: Vec<f64>,
    /// Current speed relative to the shape (1 = as calibrated, 2 = everything takes twice as long).
    pub scale: f64,
    /// Milliseconds of one LM-head (logits) row at the shape's speed, on top of the trunk rows.
    logit_row: f64,
    /// Observations folded in since calibration.
    pub observations: u64,
}

impl RowCost {
    /// A curve from `(rows, ms)` points (the trunk part only); rows outside the points are
    /// extrapolated from the nearest two.
    pub fn from_points(points: &[(usize, f64)], logit_row_ms: f64) -> RowCost {
        let mut pts: Vec<(usize, f64)> = points
            .iter()
            .copied()
            .filter(|&(r, ms)| r > 0 && ms.is_finite())
            .collect();
        pts.sort_by_key(|p| p.0);
        pts.dedup_by_key(|p| p.0);
        let shape = GRID
            .iter()
            .map(|&r| interpolate(&pts, r as f64).max(0.0))
            .collect();
        // Grid points the calibration measured count as seen twice; the rest are interpolated.
        let seen = GRID
            .iter()
            .map(|g| {
                if pts.iter().any(|p| p.0 == *g) {
                    2.0
                } else {
                    0.0
                }
            })
            .collect();
        let mut c = RowCost {
            seen,
            shape,
            scale: 1.0,
            logit_row: logit_row_ms.max(0.0),
            observations: 0,
        };
        c.make_monotone();
        c
    }

    fn shape_at(&self, rows: usize) -> f64 {
        if rows == 0 {
            return 0.0;
        }
        let pts: Vec<(usize, f64)> = GRID
            .iter()
            .copied()
            .zip(self.shape.iter().copied())
            .collect();
        interpolate(&pts, rows as f64).max(0.0)
    }

    /// Milliseconds of one logits row now.
    pub fn logit_row_ms(&self) -> f64 {
        self.logit_row * self.scale
    }

    /// Trunk milliseconds of a pass over `rows` rows (no logits), now.
    pub fn trunk_ms(&self, rows: usize) -> f64 {
        self.shape_at(rows) * self.scale
    }

    /// Milliseconds of a pass over `rows` rows of which `logit_rows` get logits.
    pub fn pass_ms(&self, rows: usize, logit_rows: usize) -> f64 {
        if rows == 0 {
            return 0.0;
        }
        self.trunk_ms(rows) + self.logit_row_ms() * logit_rows as f64
    }

    /// Extra milliseconds of going from `rows` to `rows + extra` rows (never negative).
    pub fn marginal_ms(&self, rows: usize, extra: usize) -> f64 {
        (self.trunk_ms(rows + extra) - self.trunk_ms(rows)).max(0.0)
    }

    /// Fold in one measured pass.
    pub fn observe(&mut self, rows: usize, logit_rows: usize, ms: f64) {
        if rows == 0 || !ms.is_finite() || ms < 0.0 {
            return;
        }
        let expected = self.shape_at(rows) + self.logit_row * logit_rows as f64;
        if expected <= 0.0 {
            return;
        }
        // The load scale follows every pass quickly (the first one sets it)...
        let rate = SCALE_RATE.max(1.0 / (1.0 + self.observations as f64));
        self.scale += rate * (ms / expected - self.scale);
        self.scale = self.scale.clamp(1e-3, 1e3);
        // ...and the shape slowly learns what is left: how this row count compares with the
        // row counts the recent passes had.
        let trunk = (ms / self.scale - self.logit_row * logit_rows as f64).max(0.0);
        let residual = trunk - self.shape_at(rows);
        let x = rows as f64;
        let hi = GRID
            .iter()
            .position(|&g| g as f64 >= x)
            .unwrap_or(GRID.len() - 1);
        // A row count seen rarely trusts a fresh measurement more than the start-up guess.
        let mut nudge = |i: usize, w: f64| {
            let rate = SHAPE_RATE.max(1.0 / (2.0 + self.seen[i]));
            self.shape[i] += rate * w * residual;
            self.seen[i] += w;
        };
        if hi == 0 || GRID[hi] as f64 <= x {
            nudge(hi, 1.0);
        } else {
            let lo = hi - 1;
            let w_hi = (x - GRID[lo] as f64) / (GRID[hi] - GRID[lo]) as f64;
            nudge(lo, 1.0 - w_hi);
            nudge(hi, w_hi);
        }
        self.make_monotone();
        self.observations += 1;
    }

    /// More rows never cost less, and a row never costs less than the row before it did (a pass
    /// costs a fixed part plus rows that get no cheaper): the shape is made non-decreasing and
    /// convex by pooling adjacent slopes, so noise cannot put a flat stretch — free-looking rows —
    /// after a steep one.
    fn make_monotone(&mut self) {
        let n = self.shape.len();
        let first = self.shape[0].max(0.0);
        // Slopes between grid points, weighted by the width of their interval.
        let mut blocks: Vec<(f64, f64, usize)> = Vec::with_capacity(n); // (slope, weight, count)
        for i in 1..n {
            let w = (GRID[i] - GRID[i - 1]) as f64;
            let slope = ((self.shape[i] - self.shape[i - 1]) / w).max(0.0);
            blocks.push((slope, w, 1));
            // Pool adjacent violators: a slope lower than the one before merges with it.
            while blocks.len() > 1 {
                let (s2, w2, c2) = blocks[blocks.len() - 1];
                let (s1, w1, c1) = blocks[blocks.len() - 2];
                if s1 <= s2 {
                    break;
                }
                blocks.pop();
                let last = blocks.len() - 1;
                blocks[last] = ((s1 * w1 + s2 * w2) / (w1 + w2), w1 + w2, c1 + c2);
            }
        }
        self.shape[0] = first;
        let mut i = 1;
        for (slope, _, count) in blocks {
            for _ in 0..count {
                self.shape[i] = self.shape[i - 1] + slope * (GRID[i] - GRID[i - 1]) as f64;
                i += 1;
            }
        }
    }
}

/// Piecewise-linear interpolation through sorted points, linear extrapolation past both ends.
fn interpolate(pts: &[(usize, f64)], x: f64) -> f64 {
    match pts.len() {
        0 => 0.0,
        1 => pts[0].1 * x / pts[0].0 as f64,
        _ => {
            let i = pts
                .iter()
                .position(|p| p.0 as f64 >= x)
                .unwrap_or(pts.len() - 1)
                .max(1);
            let (x0, y0) = (pts[i - 1].0 as f64, pts[i - 1].1);
            let (x1, y1) = (pts[i].0 as f64, pts[i].1);
            y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        }
    }
}

/// Everything a drafting decision prices: the target pass, the head pass, and fixed per-step and
/// per-verify extras.
#[derive(Clone, Debug)]
pub struct CostModel {
    pub target: RowCost,
    pub head: RowCost,
    /// Work outside the forward passes per decoding slot per step (sampling, text, bookkeeping).
    pub per_slot_ms: f64,
    /// Committing a verify batch (rollback / replay of the delta-net state), per verifying slot.
    pub commit_ms: f64,
}

impl CostModel {
    /// Fold in a per-slot overhead or commit measurement.
    pub fn observe_per_slot(&mut self, slots: usize, ms: f64) {
        if slots > 0 && ms.is_finite() && ms >= 0.0 {
            self.per_slot_ms += EXTRA_RATE * (ms / slots as f64 - self.per_slot_ms);
        }
    }

    pub fn observe_commit(&mut self, slots: usize, ms: f64) {
        if slots > 0 && ms.is_finite() && ms >= 0.0 {
            self.commit_ms += EXTRA_RATE * (ms / slots as f64 - self.commit_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curve_interpolates_and_extrapolates() {
        let c = RowCost::from_points(&[(1, 10.0), (4, 16.0)], 0.5);
        assert!((c.trunk_ms(1) - 10.0).abs() < 1e-9);
        assert!((c.trunk_ms(2) - 12.0).abs() < 1e-9);
        assert!((c.trunk_ms(8) - 24.0).abs() < 1e-9);
        assert!((c.pass_ms(2, 2) - 13.0).abs() < 1e-9);
        assert!((c.marginal_ms(2, 2) - 4.0).abs() < 1e-9);
        assert_eq!(c.pass_ms(0, 0), 0.0);
    }

    #[test]
    fn observations_pull_the_curve_and_keep_it_monotone() {
        let mut c = RowCost::from_points(&[(1, 10.0), (16, 40.0)], 0.0);
        // Steady load, alternating row counts: the curve learns both.
        for _ in 0..400 {
            c.observe(1, 0, 10.0);
            c.observe(4, 0, 13.0);
        }
        assert!(
            (c.trunk_ms(4) / c.trunk_ms(1) - 1.3).abs() < 0.05,
            "{} {}",
            c.trunk_ms(4),
            c.trunk_ms(1)
        );
        for _ in 0..200 {
            c.observe(8, 0, 5.0);
        }
        // A cheaper 8-row pass cannot make 8 rows cheaper than 4 rows.
        assert!(c.trunk_ms(8) >= c.trunk_ms(5));
        assert!(c.marginal_ms(4, 1) >= 0.0);
    }

    #[test]
    fn a_slow_period_at_one_row_count_scales_the_curve_instead_of_bending_it() {
        let mut c = RowCost::from_points(&[(1, 2.0), (4, 4.0)], 0.0);
        // The machine gets five times slower while only 1-row passes run.
        for _ in 0..300 {
            c.observe(1, 0, 10.0);
        }
        assert!((c.trunk_ms(1) - 10.0).abs() < 0.5);
        // Four rows still cost twice one row: the load, not the row count, changed.
        assert!(
            (c.trunk_ms(4) / c.trunk_ms(1) - 2.0).abs() < 0.2,
            "{}",
            c.trunk_ms(4) / c.trunk_ms(1)
        );
    }

    #[test]
    fn noise_cannot_make_extra_rows_look_free() {
        // A steep stretch then a flat one (a lucky fast 20-row measurement).
        let c = RowCost::from_points(&[(1, 1.0), (16, 16.0), (20, 16.5), (32, 32.0)], 0.0);
        let before = c.marginal_ms(15, 1);
        let after = c.marginal_ms(16, 1);
        assert!(
            after >= before * 0.999,
            "marginal row cost fell from {before} to {after}"
        );
        // The fit keeps the end points' total cost about right.
        assert!((c.trunk_ms(32) - 32.0).abs() < 1.0, "{}", c.trunk_ms(32));
        // A fixed cost then linear rows is left as it is.
        let d = RowCost::from_points(&[(1, 10.0), (2, 10.5), (4, 11.5), (64, 41.5)], 0.0);
        assert!((d.trunk_ms(4) - 11.5).abs() < 1e-9 && (d.trunk_ms(64) - 41.5).abs() < 1e-9);
    }

    #[test]
    fn logit_rows_are_priced_apart_from_the_trunk() {
        let c = RowCost::from_points(&[(1, 1.0), (2, 2.0)], 3.0);
        assert!((c.pass_ms(2, 2) - 8.0).abs() < 1e-9);
        let mut d = c.clone();
        for _ in 0..300 {
            d.observe(2, 2, 8.0);
        }
        assert!((d.trunk_ms(2) - 2.0).abs() < 1e-6 && (d.logit_row_ms() - 3.0).abs() < 1e-6);
    }
}
