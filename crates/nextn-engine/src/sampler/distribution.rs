//! Distributions of the sampler chain kept or read without listing every token: drafting keeps
//! the head's distribution per draft and acceptance reads the target's per row, and with top-k,
//! top-p and min-p off every token of a 248k vocabulary survives the chain.
//!
//! When no filter removes a token the chain's distribution is, in token-id order, p(id) =
//! weight(id) / total with the weights and total of [`super::math`]; the forms here compute
//! exactly those values, so a draw over any form gives the token the listed form gives.

use super::math::{softmax_weight, softmax_weights_total, wide_fn};
use super::TokenProb;

/// A row's distribution under a chain that keeps every token, read from the row on demand.
#[derive(Clone, Copy, Debug)]
pub struct WholeRow<'a> {
    row: &'a [f32],
    max: f32,
    temperature: f32,
    total: f64,
}

impl<'a> WholeRow<'a> {
    /// `row` must hold no NaN and `max` (its maximum) must be above −∞: then every token's
    /// weight is the listed chain's, and tokens a grammar masked to −∞ weigh 0.
    pub(super) fn new(row: &'a [f32], max: f32, temperature: f32, total: f64) -> Self {
        WholeRow {
            row,
            max,
            temperature,
            total,
        }
    }

    #[inline(always)]
    fn weight(&self, logit: f32) -> f64 {
        f64::from(softmax_weight(logit, self.max, self.temperature))
    }

    #[inline(always)]
    fn prob_of_logit(&self, logit: f32) -> f32 {
        (self.weight(logit) / self.total) as f32
    }

    pub fn prob(&self, id: u32) -> f32 {
        self.row
            .get(id as usize)
            .map_or(0.0, |&l| self.prob_of_logit(l))
    }
}

wide_fn! {
    /// The inverse-CDF draw over `row`'s unnormalised weights in id order: the token the listed
    /// chain's candidate walk picks with the same uniform.
    pub(super) fn draw_weighted(row: &WholeRow<'_>, u: f64) -> u32 {
        let target = u * row.total;
        let mut cumulative = 0.0f64;
        let mut last_positive = None;
        let mut weights = [0.0f32; PAIRS_BLOCK];
        for (b, logits) in row.row.chunks(PAIRS_BLOCK).enumerate() {
            for (w, &l) in weights.iter_mut().zip(logits) {
                *w = softmax_weight(l, row.max, row.temperature);
            }
            for (k, &w) in weights[..logits.len()].iter().enumerate() {
                if w > 0.0 {
                    let id = (b * PAIRS_BLOCK + k) as u32;
                    cumulative += f64::from(w);
                    last_positive = Some(id);
                    if target < cumulative {
                        return id;
                    }
                }
            }
        }
        last_positive.unwrap_or(0)
    }
}

/// Residual values max(0, p − q) of the ids `start..` (a block at most), into `block`; how many.
#[inline(always)]
fn residual_block(
    p: &WholeRow<'_>,
    q: &[f32],
    start: usize,
    block: &mut [f32; PAIRS_BLOCK],
) -> usize {
    let end = (start + PAIRS_BLOCK).min(p.row.len());
    let pairs = p.row[start..end].iter().zip(&q[start..end]);
    for (r, (&l, &qp)) in block.iter_mut().zip(pairs) {
        let pp = p.prob_of_logit(l);
        *r = (f64::from(pp) - f64::from(qp)).max(0.0) as f32;
    }
    end - start
}

wide_fn! {
    /// A draw from the residual max(0, p − q) of a whole row's p and a `q` by id over the same
    /// row, in id order: [`draw_pairs`] over those entries, a block of them computed at once.
    fn draw_residual_by_id(p: &WholeRow<'_>, q: &[f32], u: f64) -> Option<u32> {
        let mut block = [0.0f32; PAIRS_BLOCK];
        let mut total = 0.0f64;
        for start in (0..p.row.len()).step_by(PAIRS_BLOCK) {
            let n = residual_block(p, q, start, &mut block);
            for &r in &block[..n] {
                total += f64::from(r);
            }
        }
        if total.is_nan() || total <= 0.0 {
            return None;
        }
        let target = u * total;
        let mut acc = 0.0f64;
        let mut last_positive = None;
        for start in (0..p.row.len()).step_by(PAIRS_BLOCK) {
            let n = residual_block(p, q, start, &mut block);
            for (k, &r) in block[..n].iter().enumerate() {
                let id = (start + k) as u32;
                acc += f64::from(r);
                if r > 0.0 {
                    last_positive = Some(id);
                }
                if target < acc {
                    return Some(id);
                }
            }
        }
        last_positive
    }
}

wide_fn! {
    /// The chain's probabilities of a whole row into `probs` by id (weights first, then divided
    /// by their total in place, so the exponentials are taken once); returns their sum in id
    /// order, the total a draw over them starts from.
    fn whole_row_probs(row: &[f32], max: f32, temperature: f32, probs: &mut [f32]) -> f64 {
        let total = softmax_weights_total(row, max, temperature, probs);
        for p in probs.iter_mut() {
            *p = (f64::from(*p) / total) as f32;
        }
        let mut sum = 0.0f64;
        for &p in probs.iter() {
            sum += f64::from(p);
        }
        sum
    }
}

/// A distribution to draw from or look probabilities up in, in the order a draw walks it.
#[derive(Clone, Copy, Debug)]
pub enum DistRef<'a> {
    /// (id, p) pairs, as [`super::Sampler::distribution`] lists them.
    Listed(&'a [TokenProb]),
    /// p indexed by token id.
    ById(&'a [f32]),
    WholeRow(WholeRow<'a>),
}

impl<'a> DistRef<'a> {
    /// p(id); the first entry of an id in a listed distribution, 0 for an id it lacks.
    pub fn prob(&self, id: u32) -> f64 {
        let p = match self {
            DistRef::Listed(list) => list.iter().find(|t| t.id == id).map_or(0.0, |t| t.p),
            DistRef::ById(probs) => probs.get(id as usize).copied().unwrap_or(0.0),
            DistRef::WholeRow(w) => w.prob(id),
        };
        f64::from(p)
    }

    /// How many entries [`DistRef::pairs`] yields.
    pub fn len(&self) -> usize {
        match self {
            DistRef::Listed(list) => list.len(),
            DistRef::ById(probs) => probs.len(),
            DistRef::WholeRow(w) => w.row.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The (id, p) entries in draw order; tokens a listed form leaves out appear with p = 0 in
    /// the by-id forms, which changes no sum and no draw.
    pub fn pairs(&self) -> Pairs<'a> {
        match *self {
            DistRef::Listed(list) => Pairs::Listed(list.iter()),
            DistRef::ById(probs) => Pairs::ById(probs.iter().enumerate()),
            DistRef::WholeRow(row) => Pairs::WholeRow(WholeRowPairs {
                row,
                next: 0,
                block: [0.0; PAIRS_BLOCK],
                at: 0,
                filled: 0,
            }),
        }
    }

    /// Draw with a uniform `u` in [0, 1): the first entry whose cumulative mass exceeds `u` ×
    /// the total. `None` when there is no positive mass.
    pub fn draw(&self, u: f64) -> Option<u32> {
        draw_pairs(|| self.pairs(), u)
    }
}

/// The draw of [`draw_pairs`] from the residual max(0, p − q) of a whole row's p and a q by id
/// over the same vocabulary; `None` for other forms, which take the entry-by-entry way.
pub fn draw_residual_whole_row(p: DistRef<'_>, q: DistRef<'_>, u: f64) -> Option<Option<u32>> {
    match (p, q) {
        (DistRef::WholeRow(p), DistRef::ById(q)) if q.len() == p.row.len() => {
            Some(draw_residual_by_id(&p, q, u))
        }
        _ => None,
    }
}

/// Inverse-CDF draw over (id, p) entries made twice by `pairs` (once for the total, once for the
/// walk); `None` when the total is not positive.
pub fn draw_pairs<I: Iterator<Item = (u32, f32)>>(pairs: impl Fn() -> I, u: f64) -> Option<u32> {
    let total: f64 = pairs().map(|(_, p)| f64::from(p)).sum();
    draw_with_total(pairs(), total, u)
}

/// The walk of [`draw_pairs`], given the entries' total (summed in order).
fn draw_with_total(pairs: impl Iterator<Item = (u32, f32)>, total: f64, u: f64) -> Option<u32> {
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut acc = 0.0f64;
    let mut last_positive = None;
    for (id, p) in pairs {
        acc += f64::from(p);
        if p > 0.0 {
            last_positive = Some(id);
        }
        if target < acc {
            return Some(id);
        }
    }
    last_positive
}

/// Probabilities computed a block at a time, so the exponentials vectorise.
const PAIRS_BLOCK: usize = 256;

/// The entries of a [`DistRef`].
// A whole row's block of probabilities is kept inline: a `Pairs` lives for one walk, on the
// stack, and a box would cost an allocation per walk.
#[allow(clippy::large_enum_variant)]
pub enum Pairs<'a> {
    Listed(std::slice::Iter<'a, TokenProb>),
    ById(std::iter::Enumerate<std::slice::Iter<'a, f32>>),
    WholeRow(WholeRowPairs<'a>),
}

impl Iterator for Pairs<'_> {
    type Item = (u32, f32);

    #[inline]
    fn next(&mut self) -> Option<(u32, f32)> {
        match self {
            Pairs::Listed(it) => it.next().map(|t| (t.id, t.p)),
            Pairs::ById(it) => it.next().map(|(id, &p)| (id as u32, p)),
            Pairs::WholeRow(it) => it.next(),
        }
    }
}

pub struct WholeRowPairs<'a> {
    row: WholeRow<'a>,
    /// Id of the first token not yet in `block`.
    next: usize,
    block: [f32; PAIRS_BLOCK],
    at: usize,
    filled: usize,
}

impl Iterator for WholeRowPairs<'_> {
    type Item = (u32, f32);

    #[inline]
    fn next(&mut self) -> Option<(u32, f32)> {
        if self.at == self.filled {
            let end = (self.next + PAIRS_BLOCK).min(self.row.row.len());
            if self.next == end {
                return None;
            }
            let logits = &self.row.row[self.next..end];
            for (p, &l) in self.block.iter_mut().zip(logits) {
                *p = self.row.prob_of_logit(l);
            }
            self.filled = logits.len();
            self.at = 0;
            self.next = end;
        }
        let id = self.next - self.filled + self.at;
        let p = self.block[self.at];
        self.at += 1;
        Some((id as u32, p))
    }
}

/// A distribution the chain produced, kept past the row it came from (a draft's, until its
/// verification). Its buffers are reused: [`super::Sampler::distribution_into`] refills one.
#[derive(Clone, Debug, Default)]
pub struct Distribution {
    by_id: bool,
    probs: Vec<f32>,
    /// Σ probs in id order, the total a draw over them starts from.
    probs_total: f64,
    listed: Vec<TokenProb>,
}

impl Distribution {
    pub fn view(&self) -> DistRef<'_> {
        if self.by_id {
            DistRef::ById(&self.probs)
        } else {
            DistRef::Listed(&self.listed)
        }
    }

    pub fn prob(&self, id: u32) -> f64 {
        self.view().prob(id)
    }

    pub fn draw(&self, u: f64) -> Option<u32> {
        if self.by_id {
            let pairs = self.probs.iter().enumerate().map(|(id, &p)| (id as u32, p));
            draw_with_total(pairs, self.probs_total, u)
        } else {
            self.view().draw(u)
        }
    }

    /// The chain's distribution over `row` when it keeps every token (`row` as for
    /// [`WholeRow::new`]): weights, their total, then probabilities in place, so the row's
    /// exponentials are taken once.
    pub(super) fn set_whole_row(&mut self, row: &[f32], max: f32, temperature: f32) {
        self.by_id = true;
        self.listed.clear();
        // Resizing a reused buffer to the same row width writes nothing.
        self.probs.resize(row.len(), 0.0);
        self.probs_total = whole_row_probs(row, max, temperature, &mut self.probs);
    }

    pub(super) fn set_listed(&mut self, list: &[TokenProb]) {
        self.by_id = false;
        self.probs.clear();
        self.listed.clear();
        self.listed.extend_from_slice(list);
    }
}
