//! Forced acceptance: the speculative loop run at a chosen acceptance, for measuring what MTP
//! gains at the acceptance a real model reaches when the model at hand (random weights, a tiny
//! model) accepts something else.
//!
//! The head drafts as always (its full cost), the target verifies the chain (its full cost) and
//! the loop commits and rolls back as always; only the tokens of the chain are rewritten before
//! verification. With one seeded uniform `u` per step, the first `m = #{i : u < a_i}` drafts
//! become the tokens plain decoding gives at those output positions (recorded in a plain run of
//! the same request) and draft `m` a token that differs from plain decoding's. Coupled acceptance
//! keeps a draft exactly when it equals the target's own draw, which for a chain that follows
//! the plain output is the plain token: so exactly `m` drafts are kept, the output is the plain
//! output, and draft position `i` is kept in a share `a_i` of the steps (a marginal rate, as the
//! cost model's projection uses it).

/// Why a forced acceptance cannot be set up.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ForcedAcceptanceError {
    #[error("forced acceptance needs at least one rate")]
    NoRates,
    #[error("forced acceptance rate {rate} at draft position {position} is not within 0..=1")]
    OutOfRange { position: usize, rate: f64 },
    #[error(
        "forced acceptance rates are per-position marginal rates (draft i and all before it kept), so they cannot grow: {rate} at position {position} is above {previous} before it"
    )]
    Increasing {
        position: usize,
        rate: f64,
        previous: f64,
    },
}

/// The acceptance to force on one request, and the plain output it is forced towards.
#[derive(Clone, Debug, PartialEq)]
pub struct ForcedAcceptance {
    rates: Vec<f64>,
    seed: u64,
    /// Plain decoding's output for the request, by output position.
    reference: Vec<u32>,
}

impl ForcedAcceptance {
    /// `rates[i]`: the share of steps that keep draft `i` (and so all drafts before it); positions
    /// past the list take its last rate.
    pub fn new(
        rates: &[f64],
        seed: u64,
        reference: Vec<u32>,
    ) -> Result<Self, ForcedAcceptanceError> {
        if rates.is_empty() {
            return Err(ForcedAcceptanceError::NoRates);
        }
        for (position, &rate) in rates.iter().enumerate() {
            if !(0.0..=1.0).contains(&rate) {
                return Err(ForcedAcceptanceError::OutOfRange { position, rate });
            }
            if position > 0 && rate > rates[position - 1] {
                return Err(ForcedAcceptanceError::Increasing {
                    position,
                    rate,
                    previous: rates[position - 1],
                });
            }
        }
        Ok(ForcedAcceptance {
            rates: rates.to_vec(),
            seed,
            reference,
        })
    }

    fn rate(&self, position: usize) -> f64 {
        self.rates
            .get(position)
            .or(self.rates.last())
            .copied()
            .unwrap_or(0.0)
    }

    /// Rewrite the head's chain `drafts`, whose first draft sits at output position
    /// `first_index`, as described in the module documentation. Past the end of the reference
    /// output the chain is cut (the request ends there anyway).
    pub fn apply(&self, first_index: u64, drafts: &mut Vec<u32>, n_vocab: usize) {
        let u = uniform(self.seed, first_index);
        let kept = (0..drafts.len()).take_while(|&i| u < self.rate(i)).count();
        for i in 0..drafts.len() {
            let Some(&plain) = usize::try_from(first_index + i as u64)
                .ok()
                .and_then(|at| self.reference.get(at))
            else {
                drafts.truncate(i);
                return;
            };
            if i < kept {
                drafts[i] = plain;
            } else {
                // A draft still on the device may turn out to be the plain token: it is
                // replaced like one that is.
                if drafts[i] == plain || nextn_model::is_device_token(drafts[i]) {
                    drafts[i] = ((plain as usize + 1) % n_vocab.max(2)) as u32;
                }
                return;
            }
        }
    }
}

/// A uniform draw in [0, 1) that depends only on (seed, output position): SplitMix64 of both.
fn uniform(seed: u64, index: u64) -> f64 {
    let mut z = seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_must_be_marginal() {
        assert_eq!(
            ForcedAcceptance::new(&[], 1, vec![]),
            Err(ForcedAcceptanceError::NoRates)
        );
        assert!(matches!(
            ForcedAcceptance::new(&[0.9, 0.95], 1, vec![]),
            Err(ForcedAcceptanceError::Increasing { position: 1, .. })
        ));
        assert!(matches!(
            ForcedAcceptance::new(&[1.5], 1, vec![]),
            Err(ForcedAcceptanceError::OutOfRange { position: 0, .. })
        ));
    }

    /// Over many steps each position is kept (reference token) in its share of steps, the first
    /// position not kept differs from the reference, and the chain never runs past it.
    #[test]
    fn chains_follow_the_reference_at_the_requested_rates() {
        let reference: Vec<u32> = (0..20_010).map(|i| (i * 7 % 50) as u32).collect();
        let rates = [0.95, 0.86, 0.75];
        let f = ForcedAcceptance::new(&rates, 42, reference.clone()).unwrap();
        let mut kept_at = [0usize; 3];
        let steps = 10_000;
        for step in 0..steps {
            let first = (step * 2) as u64;
            let mut drafts: Vec<u32> = (0..3).map(|i| reference[step * 2 + i]).collect();
            f.apply(first, &mut drafts, 50);
            let kept = drafts
                .iter()
                .enumerate()
                .take_while(|&(i, &d)| d == reference[step * 2 + i])
                .count();
            for k in kept_at.iter_mut().take(kept) {
                *k += 1;
            }
            if kept < 3 {
                assert_ne!(drafts[kept], reference[step * 2 + kept]);
            }
        }
        for (i, &r) in rates.iter().enumerate() {
            let got = kept_at[i] as f64 / steps as f64;
            assert!((got - r).abs() < 0.015, "position {i}: {got} vs {r}");
        }
    }

    #[test]
    fn the_chain_stops_at_the_end_of_the_reference() {
        let f = ForcedAcceptance::new(&[1.0], 7, vec![5, 6, 7]).unwrap();
        let mut drafts = vec![0, 0, 0];
        f.apply(1, &mut drafts, 100);
        assert_eq!(drafts, [6, 7]);
    }
}
