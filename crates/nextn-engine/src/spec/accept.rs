//! Acceptance: which drafts of a verified step are kept, and the token that follows them.
//!
//! Row `j` of a verify pass holds the target's logits after `[id_last, d_1..d_j]`, i.e. its
//! prediction for the output position of draft `d_{j+1}`. `first_index` is the output position
//! (0 = the first generated token) that row 0 predicts.

use nextn_model::ForwardOutput;

use crate::sampler::{Draw, Sampler, TokenProb};

/// Coupled acceptance: draw `t_j` from row `j` with the request's sampler, exactly as plain
/// decoding draws the token at that output position, and keep going while it equals the next
/// draft. Returns (accepted drafts, the token after them). Every emitted token is the draw plain
/// decoding would make at its position, so the output does not depend on the drafts.
pub fn accept_coupled(
    sampler: &mut Sampler,
    drafts: &[u32],
    out: &ForwardOutput,
    first_index: u64,
) -> (usize, u32) {
    let mut accepted = 0;
    let mut next = sampler.sample_and_accept(out.logits_row(0), first_index);
    while accepted < drafts.len() && next == drafts[accepted] {
        accepted += 1;
        next = sampler.sample_and_accept(out.logits_row(accepted), first_index + accepted as u64);
    }
    (accepted, next)
}

/// Speculative sampling: draft `j`, drawn from `q_j`, is kept with probability min(1, p_j/q_j)
/// under the target's distribution `p_j` after the accepted prefix; the first rejection is
/// replaced by a draw from the residual max(0, p − q); with every draft kept, the bonus token is
/// drawn from the next row. Returns (accepted drafts, the token after them).
pub fn accept_sampled(
    sampler: &mut Sampler,
    drafts: &[u32],
    dists: &[Vec<TokenProb>],
    out: &ForwardOutput,
    first_index: u64,
) -> (usize, u32) {
    let mut accepted = 0;
    while accepted < drafts.len() && accepted < dists.len() {
        let index = first_index + accepted as u64;
        let p = sampler.distribution(out.logits_row(accepted)).to_vec();
        let coin = sampler.uniform(Draw::Accept, index);
        match accept_or_resample(&p, &dists[accepted], drafts[accepted], coin) {
            Ok(()) => {
                sampler.accept(drafts[accepted]);
                accepted += 1;
            }
            Err(residual) => {
                let u = sampler.uniform(Draw::Residual, index);
                // p == q on their common support leaves no residual mass: any draw from p is
                // then exact.
                let t = draw(&residual, u)
                    .or_else(|| draw(&p, u))
                    .unwrap_or(drafts[accepted]);
                sampler.accept(t);
                return (accepted, t);
            }
        }
    }
    let next = sampler.sample_and_accept(out.logits_row(accepted), first_index + accepted as u64);
    (accepted, next)
}

/// Draw from a distribution given as (id, p) pairs with a uniform `u` in [0, 1).
pub fn draw(dist: &[TokenProb], u: f64) -> Option<u32> {
    let total: f64 = dist.iter().map(|t| t.p as f64).sum();
    if dist.is_empty() || total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut acc = 0.0f64;
    for t in dist {
        acc += t.p as f64;
        if target < acc {
            return Some(t.id);
        }
    }
    dist.iter().rev().find(|t| t.p > 0.0).map(|t| t.id)
}

fn prob_of(dist: &[TokenProb], id: u32) -> f64 {
    dist.iter()
        .find(|t| t.id == id)
        .map(|t| t.p as f64)
        .unwrap_or(0.0)
}

/// Accept draft `d` (drawn from `q`) against the target's `p` when `coin · q(d) < p(d)`; on
/// rejection return the residual max(0, p − q) to draw the replacement from.
fn accept_or_resample(
    p: &[TokenProb],
    q: &[TokenProb],
    d: u32,
    coin: f64,
) -> Result<(), Vec<TokenProb>> {
    let (pd, qd) = (prob_of(p, d), prob_of(q, d));
    if qd > 0.0 && coin * qd < pd {
        return Ok(());
    }
    Err(p
        .iter()
        .map(|t| TokenProb {
            id: t.id,
            p: (t.p as f64 - prob_of(q, t.id)).max(0.0) as f32,
        })
        .filter(|t| t.p > 0.0)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dist(pairs: &[(u32, f32)]) -> Vec<TokenProb> {
        pairs.iter().map(|&(id, p)| TokenProb { id, p }).collect()
    }

    #[test]
    fn draw_walks_the_cumulative_distribution() {
        let d = dist(&[(3, 0.25), (7, 0.5), (9, 0.25)]);
        assert_eq!(draw(&d, 0.0), Some(3));
        assert_eq!(draw(&d, 0.3), Some(7));
        assert_eq!(draw(&d, 0.999), Some(9));
        assert_eq!(draw(&[], 0.5), None);
        assert_eq!(draw(&dist(&[(1, 0.0)]), 0.5), None);
    }

    #[test]
    fn rejection_leaves_the_residual() {
        let p = dist(&[(1, 0.5), (2, 0.5)]);
        let q = dist(&[(1, 0.9), (2, 0.1)]);
        // p(1)/q(1) = 5/9: a coin below it accepts, above it rejects.
        assert_eq!(accept_or_resample(&p, &q, 1, 0.5), Ok(()));
        let residual = accept_or_resample(&p, &q, 1, 0.6).unwrap_err();
        assert_eq!(residual.len(), 1);
        assert_eq!(residual[0].id, 2);
        assert!((residual[0].p - 0.4).abs() < 1e-6);
        // A draft the head could not have drawn is never accepted.
        assert!(accept_or_resample(&p, &dist(&[(2, 1.0)]), 1, 0.0).is_err());
    }
}
