//! Acceptance: which drafts of a verified step are kept, and the token that follows them.
//!
//! Row `j` of a verify pass holds the target's logits after `[id_last, d_1..d_j]`, i.e. its
//! prediction for the output position of draft `d_{j+1}`. `first_index` is the output position
//! (0 = the first generated token) that row 0 predicts. With a grammar, every row is masked by
//! the grammar's state after the tokens before it, and each kept token advances that state.

use std::borrow::Cow;

use nextn_model::ForwardOutput;

use crate::grammar::{Constraint, GrammarError};
use crate::sampler::{
    draw_pairs, draw_residual_whole_row, DistRef, Distribution, Draw, Sampler, TokenMask, TokenProb,
};

/// A request's grammar during acceptance: its state (after `id_last`) and the masks drafting
/// already computed for rows `0..masks.len()` (the same states, when the drafts before a row
/// are kept).
pub struct RowGrammar<'a> {
    pub constraint: &'a mut Constraint,
    pub masks: &'a [TokenMask],
}

impl RowGrammar<'_> {
    fn mask(&mut self, row: usize) -> Result<Cow<'_, TokenMask>, GrammarError> {
        match self.masks.get(row) {
            Some(m) if m.count() == 0 => Err(GrammarError::NoToken),
            Some(m) => Ok(Cow::Borrowed(m)),
            None => Ok(Cow::Owned(self.constraint.mask()?)),
        }
    }
}

/// The mask of row `row` (none without a grammar); `Ok(None)` inside when the grammar admits no
/// token there, so the output ends before that row.
fn row_mask<'g>(
    grammar: &'g mut Option<RowGrammar<'_>>,
    row: usize,
) -> Result<RowMask<'g>, GrammarError> {
    match grammar.as_mut().map(|g| g.mask(row)).transpose() {
        Ok(mask) => Ok(RowMask::Allowed(mask)),
        Err(GrammarError::NoToken) => Ok(RowMask::DeadEnd),
        Err(e) => Err(e),
    }
}

/// A row's mask, or the grammar's dead end (a state no token continues: the request's grammar
/// cannot be completed from the output so far).
enum RowMask<'g> {
    Allowed(Option<Cow<'g, TokenMask>>),
    DeadEnd,
}

/// What acceptance kept of a verified row set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accepted {
    /// Drafts kept.
    pub drafts: usize,
    /// The token drawn after them; `None` when the request's grammar admits no token there (the
    /// output ends after the kept drafts).
    pub next: Option<u32>,
}

impl Accepted {
    fn token(drafts: usize, t: u32) -> Self {
        Accepted {
            drafts,
            next: Some(t),
        }
    }

    fn dead_end(drafts: usize) -> Self {
        Accepted { drafts, next: None }
    }
}

/// The grammar takes `token`; true when the grammar is then complete (the output ends there).
fn advance(grammar: &mut Option<RowGrammar<'_>>, token: u32) -> Result<bool, GrammarError> {
    match grammar {
        Some(g) => {
            g.constraint.consume(token)?;
            Ok(g.constraint.is_finished())
        }
        None => Ok(false),
    }
}

/// Coupled acceptance: draw `t_j` from row `j` with the request's sampler, exactly as plain
/// decoding draws the token at that output position, and keep going while it equals the next
/// draft. Returns (accepted drafts, the token after them). Every emitted token is the draw plain
/// decoding would make at its position, so the output does not depend on the drafts. A token
/// that completes the grammar ends the output: it is returned as the last token.
pub fn accept_coupled(
    sampler: &mut Sampler,
    drafts: &[u32],
    out: &ForwardOutput,
    first_index: u64,
    mut grammar: Option<RowGrammar<'_>>,
) -> Result<Accepted, GrammarError> {
    let mut accepted = 0;
    loop {
        let index = first_index + accepted as u64;
        let RowMask::Allowed(mask) = row_mask(&mut grammar, accepted)? else {
            return Ok(Accepted::dead_end(accepted));
        };
        let t = match out.top1(accepted) {
            // Only a row whose draw is its argmax comes back as its top-1 (no mask, no penalty,
            // no bias); an all-NaN row draws 0, as the sampler's argmax does.
            Some(top) => {
                let t = top.id.unwrap_or(0);
                sampler.accept(t);
                t
            }
            None => {
                sampler.sample_masked_and_accept(out.logits_row(accepted), mask.as_deref(), index)
            }
        };
        drop(mask);
        // A token that completes the grammar is the last one, drafted or not.
        if advance(&mut grammar, t)? {
            return Ok(Accepted::token(accepted, t));
        }
        if accepted < drafts.len() && t == drafts[accepted] {
            accepted += 1;
        } else {
            return Ok(Accepted::token(accepted, t));
        }
    }
}

/// Speculative sampling: draft `j`, drawn from `q_j`, is kept with probability min(1, p_j/q_j)
/// under the target's distribution `p_j` after the accepted prefix; the first rejection is
/// replaced by a draw from the residual max(0, p − q); with every draft kept, the bonus token is
/// drawn from the next row.
pub fn accept_sampled(
    sampler: &mut Sampler,
    drafts: &[u32],
    dists: &[Distribution],
    out: &ForwardOutput,
    first_index: u64,
    mut grammar: Option<RowGrammar<'_>>,
) -> Result<Accepted, GrammarError> {
    let mut accepted = 0;
    while accepted < drafts.len() && accepted < dists.len() {
        let index = first_index + accepted as u64;
        let RowMask::Allowed(mask) = row_mask(&mut grammar, accepted)? else {
            return Ok(Accepted::dead_end(accepted));
        };
        // Both draws are keyed by (seed, kind, index), so taking them first changes nothing and
        // lets `p` stay a view into the sampler instead of a list (a 248k-entry one with top_k 0).
        let coin = sampler.uniform(Draw::Accept, index);
        let u = sampler.uniform(Draw::Residual, index);
        let p = sampler.distribution_view(out.logits_row(accepted), mask.as_deref());
        let draft = drafts[accepted];
        let kept = accept_or_resample(p, dists[accepted].view(), draft, coin, u);
        drop(mask);
        match kept {
            None => {
                sampler.accept(draft);
                if advance(&mut grammar, draft)? {
                    return Ok(Accepted::token(accepted, draft));
                }
                accepted += 1;
            }
            Some(t) => {
                sampler.accept(t);
                let _ = advance(&mut grammar, t)?;
                return Ok(Accepted::token(accepted, t));
            }
        }
    }
    let index = first_index + accepted as u64;
    let RowMask::Allowed(mask) = row_mask(&mut grammar, accepted)? else {
        return Ok(Accepted::dead_end(accepted));
    };
    let next = sampler.sample_masked_and_accept(out.logits_row(accepted), mask.as_deref(), index);
    drop(mask);
    let _ = advance(&mut grammar, next)?;
    Ok(Accepted::token(accepted, next))
}

/// Draw from a distribution given as (id, p) pairs with a uniform `u` in [0, 1).
pub fn draw(dist: &[TokenProb], u: f64) -> Option<u32> {
    DistRef::Listed(dist).draw(u)
}

/// Accept draft `d` (drawn from `q`) against the target's `p` when `coin · q(d) < p(d)`
/// (`None`); on rejection the replacement, drawn with `u` from the residual max(0, p − q).
fn accept_or_resample(p: DistRef<'_>, q: DistRef<'_>, d: u32, coin: f64, u: f64) -> Option<u32> {
    let (pd, qd) = (p.prob(d), q.prob(d));
    if qd > 0.0 && coin * qd < pd {
        return None;
    }
    // p == q on their common support leaves no residual mass: any draw from p is then exact.
    Some(draw_residual(p, q, u).or_else(|| p.draw(u)).unwrap_or(d))
}

/// A draw from max(0, p − q) in p's order, computed entry by entry in both passes of the draw
/// rather than listed.
fn draw_residual(p: DistRef<'_>, q: DistRef<'_>, u: f64) -> Option<u32> {
    if let Some(t) = draw_residual_whole_row(p, q, u) {
        return t;
    }
    let q_of = QLookup::new(q);
    draw_pairs(
        || {
            p.pairs()
                .map(|(id, pp)| (id, (f64::from(pp) - q_of.get(id)).max(0.0) as f32))
        },
        u,
    )
}

/// q(id) for every id of p: direct for q by id and for a short list, through an index for a
/// long list (a lookup per entry of p would cost |p|·|q|, 6·10^10 steps for 248k tokens).
enum QLookup<'a> {
    Direct(DistRef<'a>),
    Indexed(QIndex),
}

impl<'a> QLookup<'a> {
    /// Up to this many listed entries a scan beats building an index.
    const SCAN: usize = 32;

    fn new(q: DistRef<'a>) -> Self {
        match q {
            DistRef::Listed(list) if list.len() > Self::SCAN => Self::Indexed(QIndex::new(list)),
            q => Self::Direct(q),
        }
    }

    fn get(&self, id: u32) -> f64 {
        match self {
            Self::Direct(q) => q.prob(id),
            Self::Indexed(index) => index.get(id),
        }
    }
}

/// q(id) for every id of a listed draft distribution, holding the first entry of an id as
/// [`DistRef::prob`] finds it.
enum QIndex {
    /// Indexed by id: for a distribution over much of the vocabulary one array costs a fraction
    /// of hashing every entry.
    Dense(Vec<f32>),
    Sparse(std::collections::HashMap<u32, f32>),
}

impl QIndex {
    /// A dense table once q covers at least 1/16 of the ids up to its largest.
    const DENSE_SHARE: usize = 16;

    fn new(q: &[TokenProb]) -> Self {
        let Some(max_id) = q.iter().map(|t| t.id as usize).max() else {
            return Self::Sparse(Default::default());
        };
        if q.len() * Self::DENSE_SHARE > max_id {
            // NaN marks an id not seen yet (probabilities are never NaN).
            let mut table = vec![f32::NAN; max_id + 1];
            for t in q {
                let slot = &mut table[t.id as usize];
                if slot.is_nan() {
                    *slot = t.p;
                }
            }
            Self::Dense(table)
        } else {
            let mut map = std::collections::HashMap::with_capacity(q.len());
            for t in q {
                map.entry(t.id).or_insert(t.p);
            }
            Self::Sparse(map)
        }
    }

    fn get(&self, id: u32) -> f64 {
        let p = match self {
            Self::Dense(table) => table.get(id as usize).copied().filter(|p| !p.is_nan()),
            Self::Sparse(map) => map.get(&id).copied(),
        };
        p.map_or(0.0, f64::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grammar that admits no token at a row (a dead end) ends the output there: the drafts
    /// before it are kept, no token is drawn, and it is not an error.
    #[test]
    fn a_dead_end_keeps_the_drafts_before_it_and_draws_nothing() {
        use crate::grammar::{GrammarCompiler, GrammarSource};
        use crate::sampler::SamplerConfig;
        use crate::tokenizer::Tokenizer;
        let file = nextn_gguf::GgufFile::open(nextn_testdata::bundled_model()).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let n_vocab = tok.vocab_size();
        let compiler = GrammarCompiler::new(&tok, n_vocab).unwrap();
        let mut constraint = compiler
            .compile(&GrammarSource::Regex("[a-z]+".into()))
            .unwrap();
        let letter = constraint.mask().unwrap().first().unwrap();
        // Row 0 allows one letter, which the target's row 0 favours; row 1 allows nothing.
        let mut one = vec![0u32; n_vocab.div_ceil(32)];
        one[letter as usize / 32] |= 1 << (letter % 32);
        let masks = [
            TokenMask::from_words(one, n_vocab),
            TokenMask::from_words(vec![0; n_vocab.div_ceil(32)], n_vocab),
        ];
        let mut logits = vec![0.0f32; 3 * n_vocab];
        logits[letter as usize] = 10.0;
        let out = ForwardOutput {
            logits,
            hidden: Vec::new(),
            device_hidden: None,
            tokens: Vec::new(),
            n_vocab,
            top1: Vec::new(),
        };
        let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
        let grammar = RowGrammar {
            constraint: &mut constraint,
            masks: &masks,
        };
        let kept = accept_coupled(&mut sampler, &[letter, letter], &out, 0, Some(grammar)).unwrap();
        assert_eq!(kept, Accepted::dead_end(1));
    }

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
        let (p, q) = (DistRef::Listed(&p), DistRef::Listed(&q));
        // p(1)/q(1) = 5/9: a coin below it accepts, above it rejects.
        assert_eq!(accept_or_resample(p, q, 1, 0.5, 0.0), None);
        // The residual max(0, p − q) holds only token 2, whatever the uniform.
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(accept_or_resample(p, q, 1, 0.6, u), Some(2));
        }
        // A draft the head could not have drawn is never accepted.
        let only_2 = dist(&[(2, 1.0)]);
        assert_eq!(
            accept_or_resample(p, DistRef::Listed(&only_2), 1, 0.0, 0.1),
            Some(1)
        );
        // p == q leaves no residual: the replacement is a draw from p.
        assert_eq!(accept_or_resample(p, p, 1, 1.0, 0.75), Some(2));
    }

    /// Both layouts of the q index give q(id), the first entry of a repeated id, and 0 for an id
    /// q lacks.
    #[test]
    fn q_index_dense_and_sparse_agree() {
        let q = dist(&[(7, 0.25), (3, 0.5), (7, 0.125), (200_000, 0.0625)]);
        let sparse = QIndex::new(&q);
        assert!(matches!(sparse, QIndex::Sparse(_)));
        let near = dist(&[(7, 0.25), (3, 0.5), (7, 0.125), (9, 0.0625)]);
        let dense = QIndex::new(&near);
        assert!(matches!(dense, QIndex::Dense(_)));
        for index in [&sparse, &dense] {
            assert_eq!(index.get(7), 0.25);
            assert_eq!(index.get(3), 0.5);
            assert_eq!(index.get(4), 0.0);
            assert_eq!(index.get(1_000_000), 0.0);
        }
        assert_eq!(sparse.get(200_000), 0.0625);
        assert_eq!(dense.get(9), 0.0625);
        assert_eq!(QIndex::new(&[]).get(0), 0.0);
    }

    /// The residual over a whole 248,320-token vocabulary (top_k 0, min_p 0) is the per-token
    /// max(0, p − q), in p's order: a draw from it, with p and q listed in any order or held by
    /// id, is the draw from that residual written out, and takes a pass over each where a lookup
    /// per token took minutes.
    #[test]
    fn residual_over_the_whole_vocabulary() {
        let n = 248_320u32;
        let p_of = |id: u32| ((id % 97) + 1) as f32 / 1e7;
        // q missing every seventh token.
        let q_of = |id: u32| {
            if id.is_multiple_of(7) {
                0.0
            } else {
                ((id % 89) + 1) as f32 / 1e7
            }
        };
        let p: Vec<TokenProb> = (0..n).map(|id| TokenProb { id, p: p_of(id) }).collect();
        let q_listed: Vec<TokenProb> = (0..n)
            .rev()
            .filter(|id| !id.is_multiple_of(7))
            .map(|id| TokenProb { id, p: q_of(id) })
            .collect();
        let q_by_id: Vec<f32> = (0..n).map(q_of).collect();
        let p_by_id: Vec<f32> = (0..n).map(p_of).collect();
        let want: Vec<TokenProb> = p
            .iter()
            .map(|t| TokenProb {
                id: t.id,
                p: (f64::from(t.p) - f64::from(q_of(t.id))).max(0.0) as f32,
            })
            .filter(|t| t.p > 0.0)
            .collect();
        for u in [0.0, 0.123, 0.5, 0.987_654] {
            let expected = draw(&want, u);
            assert!(expected.is_some());
            for (p, q) in [
                (DistRef::Listed(&p), DistRef::Listed(&q_listed)),
                (DistRef::Listed(&p), DistRef::ById(&q_by_id)),
                (DistRef::ById(&p_by_id), DistRef::Listed(&q_listed)),
                (DistRef::ById(&p_by_id), DistRef::ById(&q_by_id)),
            ] {
                assert_eq!(accept_or_resample(p, q, 7, 1.0, u), expected, "u {u}");
            }
        }
    }
}
