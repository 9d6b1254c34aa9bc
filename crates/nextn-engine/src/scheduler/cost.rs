//! Measured step costs: how long a target forward (or a head pass) takes as a function of the rows
//! in it. Seeded by a short calibration at start-up and refined online from every step the
//! scheduler runs, so the drafting policy prices rows with this machine's real numbers.

/// Grid of row counts at which the cost curve is kept; between points it is linear.
const GRID: [usize; 26] = [
    1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512,
    768, 1024,
];

/// Share of an observation's residual that moves the curve (an exponential moving average).
const LEARN_RATE: f64 = 0.08;

/// Milliseconds of one pass as a piecewise-linear function of its row count.
#[derive(Clone, Debug)]
pub struct RowCost {
    ms: Vec<f64>,
    /// Milliseconds of one LM-head (logits) row, on top of the trunk rows.
    pub logit_row_ms: f64,
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
        let ms = GRID
            .iter()
            .map(|&r| interpolate(&pts, r as f64).max(0.0))
            .collect();
        let mut c = RowCost {
            ms,
            logit_row_ms: logit_row_ms.max(0.0),
            observations: 0,
        };
        c.make_monotone();
        c
    }

    /// Trunk milliseconds of a pass over `rows` rows (no logits).
    pub fn trunk_ms(&self, rows: usize) -> f64 {
        if rows == 0 {
            return 0.0;
        }
        let pts: Vec<(usize, f64)> = GRID.iter().copied().zip(self.ms.iter().copied()).collect();
        interpolate(&pts, rows as f64).max(0.0)
    }

    /// Milliseconds of a pass over `rows` rows of which `logit_rows` get logits.
    pub fn pass_ms(&self, rows: usize, logit_rows: usize) -> f64 {
        if rows == 0 {
            return 0.0;
        }
        self.trunk_ms(rows) + self.logit_row_ms * logit_rows as f64
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
        let trunk = (ms - self.logit_row_ms * logit_rows as f64).max(0.0);
        let residual = trunk - self.trunk_ms(rows);
        let x = rows as f64;
        let hi = GRID
            .iter()
            .position(|&g| g as f64 >= x)
            .unwrap_or(GRID.len() - 1);
        if hi == 0 || GRID[hi] as f64 <= x {
            self.ms[hi] += LEARN_RATE * residual;
        } else {
            let lo = hi - 1;
            let w_hi = (x - GRID[lo] as f64) / (GRID[hi] - GRID[lo]) as f64;
            self.ms[lo] += LEARN_RATE * (1.0 - w_hi) * residual;
            self.ms[hi] += LEARN_RATE * w_hi * residual;
        }
        self.observations += 1;
        self.make_monotone();
    }

    /// More rows never cost less: noise must not make extra rows look free.
    fn make_monotone(&mut self) {
        for v in &mut self.ms {
            *v = v.max(0.0);
        }
        for i in 1..self.ms.len() {
            if self.ms[i] < self.ms[i - 1] {
                self.ms[i] = self.ms[i - 1];
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
            self.per_slot_ms += LEARN_RATE * (ms / slots as f64 - self.per_slot_ms);
        }
    }

    pub fn observe_commit(&mut self, slots: usize, ms: f64) {
        if slots > 0 && ms.is_finite() && ms >= 0.0 {
            self.commit_ms += LEARN_RATE * (ms / slots as f64 - self.commit_ms);
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
        for _ in 0..200 {
            c.observe(4, 0, 30.0);
        }
        assert!((c.trunk_ms(4) - 30.0).abs() < 0.5, "{}", c.trunk_ms(4));
        for _ in 0..200 {
            c.observe(8, 0, 5.0);
        }
        // A cheaper 8-row pass cannot make 8 rows cheaper than 4 rows.
        assert!(c.trunk_ms(8) >= c.trunk_ms(5));
        assert!(c.marginal_ms(4, 1) >= 0.0);
    }

    #[test]
    fn logit_rows_are_taken_out_before_fitting_the_trunk() {
        let mut c = RowCost::from_points(&[(1, 1.0), (2, 2.0)], 3.0);
        for _ in 0..300 {
            c.observe(2, 2, 2.0 + 6.0);
        }
        assert!((c.trunk_ms(2) - 2.0).abs() < 1e-6);
    }
}
