//! What a forward pass takes and gives, shared by the trunk ([`crate::Model`]), the NextN head
//! ([`crate::NextnHead`]), their layers and their device copies: one sequence's rows in a batch,
//! which rows need logits, the output, and the tail every CPU pass ends with.

use crate::cache::{LayerCache, SequenceState};
use crate::ops;
use crate::ModelError;

/// One sequence's share of a batch inside a layer: its rows, where they start, its cache.
pub struct Segment<'c> {
    pub rows: std::ops::Range<usize>,
    pub start_pos: usize,
    pub cache: &'c mut LayerCache,
    /// Keep the rows pending (speculative verify) instead of committing them.
    pub verify: bool,
    /// The rotary positions of the rows.
    pub positions: crate::ops::RowPositions,
}

/// One sequence's part of a multi-sequence forward pass.
pub struct BatchItem<'s> {
    pub tokens: &'s [u32],
    pub state: &'s mut SequenceState,
    pub logits: LogitRows,
    /// What of those rows comes back.
    pub readback: Readback,
    /// A speculative verify: rows stay pending until [`crate::Model::commit`].
    pub verify: bool,
}

/// What of each logits row a pass hands back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Readback {
    /// The whole row: `n_vocab` floats ([`ForwardOutput::logits`]).
    #[default]
    Logits,
    /// Only the row's top-1 ([`ForwardOutput::top1`]), for a row whose token is the argmax of
    /// the raw logits (greedy sampling with no penalty, logit bias, grammar or log
    /// probabilities; a greedy draft). On the device the reduction runs there and 8 bytes a row
    /// come back instead of `4 · n_vocab`; a host pass has nothing to copy and hands back the
    /// whole rows, with `top1` empty.
    Top1,
}

/// A logits row reduced to its top-1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowTop1 {
    /// The lowest index of the row's largest logit that is not NaN (−0 equals +0); `None`
    /// when every logit is NaN.
    pub id: Option<u32>,
    pub logit: f32,
}

/// Which rows of a batch need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
}

impl LogitRows {
    /// The first row and the number of rows that need logits among `len` rows.
    pub(crate) fn span(self, len: usize) -> (usize, usize) {
        match self {
            _ if len == 0 => (0, 0),
            LogitRows::None => (0, 0),
            LogitRows::Last => (len - 1, 1),
            LogitRows::All => (0, len),
        }
    }
}

/// Ids at or above this stand for a token the device drafted and has not read back (the head's
/// greedy top-1 in a head pass recorded without a read-back): the target pass that takes them
/// gathers their embeddings on the device and hands back what they were
/// ([`ForwardOutput::tokens`]). Above every vocabulary and below image placeholder ids.
pub const DEVICE_TOKEN: u32 = nextn_gpu::kernels::matvec::DEVICE_TOKEN;

/// Whether `id` stands for a token drafted on the device and not read back yet.
pub fn is_device_token(id: u32) -> bool {
    (DEVICE_TOKEN..DEVICE_TOKEN + DEVICE_TOKENS).contains(&id)
}

/// How many drafted tokens a step's head passes may leave on the device.
pub const DEVICE_TOKENS: u32 = 4096;

/// Post-norm hidden rows a device head pass left on the device without reading them back: rows
/// `first..first + count` of the head pass numbered `pass`. Only the head's next pass can take
/// them (its own rows overwrite them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRows {
    pub pass: u64,
    pub first: usize,
    pub count: usize,
}

impl DeviceRows {
    /// The last of the rows.
    pub fn last(self) -> DeviceRows {
        DeviceRows {
            pass: self.pass,
            first: self.first + self.count.saturating_sub(1),
            count: self.count.min(1),
        }
    }
}

/// The hidden states a head pass pairs with its tokens: rows of the host's, or rows the
/// head's previous pass left on the device (a chained draft).
#[derive(Clone, Copy, Debug)]
pub enum HiddenPrev<'a> {
    Host(&'a [f32]),
    Device(DeviceRows),
}

/// What a forward pass returns.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// Post-final-norm hidden state of every row (`n × n_embd`): the NextN head's seed. Empty
    /// when the rows stayed on the device (`device_hidden`).
    pub hidden: Vec<f32>,
    /// Where the hidden rows are when a device head pass left them there.
    pub device_hidden: Option<DeviceRows>,
    /// The rows' tokens as the pass took them, when some were drafted on the device
    /// ([`DEVICE_TOKEN`]): each id read back, `None` for a draft that came to no token (every
    /// logit NaN or −∞); empty when the rows held no such token.
    pub tokens: Vec<Option<u32>>,
    /// Logits of the requested rows (`rows × n_vocab`), in row order; empty when they came back
    /// as `top1`.
    pub logits: Vec<f32>,
    pub n_vocab: usize,
    /// The requested rows' top-1, in row order, when they were read back as [`Readback::Top1`]
    /// (and `logits` is empty); empty otherwise.
    pub top1: Vec<RowTop1>,
}

impl ForwardOutput {
    /// An output without rows.
    pub(crate) fn empty(n_vocab: usize) -> ForwardOutput {
        ForwardOutput {
            hidden: Vec::new(),
            device_hidden: None,
            tokens: Vec::new(),
            logits: Vec::new(),
            n_vocab,
            top1: Vec::new(),
        }
    }

    pub fn logits_row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.n_vocab..(i + 1) * self.n_vocab]
    }

    /// Row `i`'s top-1 when only that came back; `None` when the row came back whole.
    pub fn top1(&self, i: usize) -> Option<RowTop1> {
        self.top1.get(i).copied()
    }
}

/// One sequence's rows in a head pass: `tokens[i]` at position `start_pos + i`, paired with
/// `hidden_prev[i]`, the post-norm hidden state of the position before (the target's, or the
/// head's own for a chained draft).
pub struct HeadBatchItem<'a> {
    pub tokens: &'a [u32],
    pub hidden_prev: HiddenPrev<'a>,
    pub start_pos: usize,
    /// Cache rows earlier images took beyond the rotary positions they advanced: row `i` sits
    /// at rotary position `start_pos + i - rope_shift`, as in the trunk.
    pub rope_shift: usize,
    /// The sequence's head cache; the rows are appended to it.
    pub cache: &'a mut LayerCache,
    pub logits: LogitRows,
    /// What of those rows comes back.
    pub readback: Readback,
}

/// The end of a CPU pass over `h` (`n × e`, `e = norm.len()`), whose parts are
/// `(first row, rows, which need logits)`: the final norm of every row, one LM-head product
/// (`lm_head(rows, n) -> n × n_vocab logits`) over the rows that need logits, and each part's
/// post-norm hidden rows and logits.
pub(crate) fn finish_pass(
    h: &[f32],
    norm: &[f32],
    eps: f32,
    parts: &[(usize, usize, LogitRows)],
    n_vocab: usize,
    lm_head: impl FnOnce(&[f32], usize) -> Result<Vec<f32>, ModelError>,
) -> Result<Vec<ForwardOutput>, ModelError> {
    let e = norm.len();
    let mut hidden = vec![0.0f32; h.len()];
    ops::rms_norm_rows(h, norm, eps, &mut hidden);
    let (picked, ranges) = gather_logit_rows(&hidden, e, parts.iter().copied());
    let n_picked = picked.len() / e.max(1);
    let logits = lm_head(&picked, n_picked)?;
    Ok(parts
        .iter()
        .zip(&ranges)
        .map(|(&(start, len, _), &(lr, count))| ForwardOutput {
            hidden: hidden[start * e..(start + len) * e].to_vec(),
            device_hidden: None,
            tokens: Vec::new(),
            logits: logits[lr * n_vocab..(lr + count) * n_vocab].to_vec(),
            n_vocab,
            top1: Vec::new(),
        })
        .collect())
}

/// The hidden rows (`e` wide) that need logits, copied together for one LM-head product, from
/// parts `(first row, rows, which need logits)` of a batch; and for each part, where its logit
/// rows start in the product and how many there are.
fn gather_logit_rows(
    hidden: &[f32],
    e: usize,
    parts: impl Iterator<Item = (usize, usize, LogitRows)>,
) -> (Vec<f32>, Vec<(usize, usize)>) {
    let mut picked = Vec::new();
    let mut ranges = Vec::new();
    for (start, len, rows) in parts {
        let (first, count) = rows.span(len);
        ranges.push((picked.len() / e.max(1), count));
        picked.extend_from_slice(&hidden[(start + first) * e..(start + first + count) * e]);
    }
    (picked, ranges)
}
