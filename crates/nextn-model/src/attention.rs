//! Gated full attention (docs/MODEL.md, "Gated full attention"): per-head interleaved query/gate
//! projection, q/k RMSNorm, partial rotary embedding, grouped-query causal softmax attention over
//! the layer's KV cache, and a sigmoid output gate.

use std::ops::Range;
use std::sync::Mutex;

use nextn_quant::kernels::ThreadPool;

use crate::batch::Segment;
use crate::cache::{KvLayer, LayerCache};
use crate::config::{Qwen35Config, RopeScaling};
use crate::ops::{self, RopeTable};
use crate::simd;
use crate::weights::{Linear, WeightLoader};
use crate::ModelError;

pub struct GatedAttention {
    /// Output rows per head: `head_dim` query rows then `head_dim` gate rows.
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    n_rot: usize,
    rope_base: f32,
    rope_scale: f32,
    rope_sections: [i32; 4],
    eps: f32,
}

impl GatedAttention {
    /// Bind `blk.{il}.attn_*` for a layer with the given head counts.
    pub fn load(w: &WeightLoader, il: usize, cfg: &Qwen35Config) -> Result<Self, ModelError> {
        let p = |n: &str| format!("blk.{il}.{n}");
        let (n_head, n_head_kv, hd, e) =
            (cfg.n_head[il], cfg.n_head_kv[il], cfg.head_dim, cfg.n_embd);
        Ok(GatedAttention {
            wq: w.linear(&p("attn_q.weight"), 2 * n_head * hd, e)?,
            wk: w.linear(&p("attn_k.weight"), n_head_kv * hd, e)?,
            wv: w.linear(&p("attn_v.weight"), n_head_kv * hd, e)?,
            wo: w.linear(&p("attn_output.weight"), e, n_head * hd)?,
            q_norm: w.vector(&p("attn_q_norm.weight"), &[hd as u64])?,
            k_norm: w.vector(&p("attn_k_norm.weight"), &[hd as u64])?,
            n_head,
            n_head_kv,
            head_dim: hd,
            n_rot: cfg.n_rot,
            rope_base: cfg.rope_freq_base,
            rope_scale: match cfg.rope_scaling {
                RopeScaling::None => 1.0,
                RopeScaling::Linear { freq_scale } => freq_scale,
            },
            rope_sections: cfg.rope_sections,
            eps: cfg.rms_eps,
        })
    }

    /// Attend the rows of every segment (each one sequence's consecutive rows, at positions
    /// `start_pos..`), appending their keys and values to that sequence's cache. The projections
    /// run once over all `n` rows; attention runs per sequence. `x` and `out` are `n × n_embd`.
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        segments: &mut [Segment],
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let hd = self.head_dim;
        let (q_width, kv_width) = (2 * self.n_head * hd, self.n_head_kv * hd);
        let mut qg = vec![0.0f32; n * q_width];
        let mut k = vec![0.0f32; n * kv_width];
        let mut v = vec![0.0f32; n * kv_width];
        self.wq.forward(x, n, &mut qg, pool)?;
        self.wk.forward(x, n, &mut k, pool)?;
        self.wv.forward(x, n, &mut v, pool)?;

        let mut attn = vec![0.0f32; n * self.n_head * hd];
        for seg in segments.iter_mut() {
            let LayerCache::Attention(kv) = &mut *seg.cache else {
                return Err(ModelError::WrongCacheKind {
                    layer: "attention",
                    found: "delta-net",
                });
            };
            let r = seg.rows.clone();
            self.attend(
                &qg[r.start * q_width..r.end * q_width],
                &mut k[r.start * kv_width..r.end * kv_width],
                &v[r.start * kv_width..r.end * kv_width],
                seg.start_pos,
                seg.positions,
                kv,
                &mut attn[r.start * self.n_head * hd..r.end * self.n_head * hd],
                pool,
            )?;
        }
        self.wo.forward(&attn, n, out, pool)
    }

    /// Append the keys and values of the rows of every segment to that sequence's cache, as
    /// [`GatedAttention::forward`] appends them (the same products, norms and rotary positions,
    /// so the same bits), without attending. For rows whose output nothing reads but whose
    /// entries later rows attend to: the NextN head's rows before the one it drafts from. `x`
    /// holds the normed rows (`n × n_embd`); each segment names its rows in it.
    pub fn store_keys_values(
        &self,
        x: &[f32],
        n: usize,
        segments: &mut [Segment],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let hd = self.head_dim;
        let kv_width = self.n_head_kv * hd;
        let mut k = vec![0.0f32; n * kv_width];
        let mut v = vec![0.0f32; n * kv_width];
        self.wk.forward(x, n, &mut k, pool)?;
        self.wv.forward(x, n, &mut v, pool)?;
        for seg in segments.iter_mut() {
            let LayerCache::Attention(kv) = &mut *seg.cache else {
                return Err(ModelError::WrongCacheKind {
                    layer: "attention",
                    found: "delta-net",
                });
            };
            if kv.len() != seg.start_pos {
                return Err(ModelError::CachePosition {
                    layer: "attention",
                    cached: kv.len(),
                    start: seg.start_pos,
                });
            }
            for (i, row) in seg.rows.clone().enumerate() {
                let rope = RopeTable::new_3d(
                    seg.positions.at(seg.start_pos, i),
                    self.n_rot,
                    self.rope_base,
                    self.rope_scale,
                    self.rope_sections,
                );
                let ki = &mut k[row * kv_width..(row + 1) * kv_width];
                ops::rms_norm_heads(ki, &self.k_norm, self.eps);
                ki.chunks_exact_mut(hd).for_each(|head| rope.apply(head));
                kv.push(ki, &v[row * kv_width..(row + 1) * kv_width]);
            }
        }
        Ok(())
    }

    /// One sequence's rows: q/k norms, RoPE, cache append, causal softmax attention, output gate.
    // The slices are one sequence's part of the batch's q/k/v/output buffers, cut by the caller.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        qg: &[f32],
        k: &mut [f32],
        v: &[f32],
        start_pos: usize,
        positions: crate::ops::RowPositions,
        kv: &mut KvLayer,
        attn: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        if kv.len() != start_pos {
            return Err(ModelError::CachePosition {
                layer: "attention",
                cached: kv.len(),
                start: start_pos,
            });
        }
        let hd = self.head_dim;
        let (q_width, kv_width) = (2 * self.n_head * hd, self.n_head_kv * hd);
        let n = qg.len() / q_width;
        // Queries de-interleaved to [row][head][hd]; gates kept aside.
        let mut q = vec![0.0f32; n * self.n_head * hd];
        let mut gate = vec![0.0f32; n * self.n_head * hd];
        for i in 0..n {
            let rope = RopeTable::new_3d(
                positions.at(start_pos, i),
                self.n_rot,
                self.rope_base,
                self.rope_scale,
                self.rope_sections,
            );
            for h in 0..self.n_head {
                let src = &qg[i * q_width + h * 2 * hd..];
                let dst = (i * self.n_head + h) * hd;
                q[dst..dst + hd].copy_from_slice(&src[..hd]);
                gate[dst..dst + hd].copy_from_slice(&src[hd..2 * hd]);
            }
            let qi = &mut q[i * self.n_head * hd..(i + 1) * self.n_head * hd];
            ops::rms_norm_heads(qi, &self.q_norm, self.eps);
            qi.chunks_exact_mut(hd).for_each(|head| rope.apply(head));
            let ki = &mut k[i * kv_width..(i + 1) * kv_width];
            ops::rms_norm_heads(ki, &self.k_norm, self.eps);
            ki.chunks_exact_mut(hd).for_each(|head| rope.apply(head));
            kv.push(ki, &v[i * kv_width..(i + 1) * kv_width]);
        }

        // Causal attention: row i sees positions 0..=start_pos+i. Each (row, head) is computed
        // alone, so its result depends neither on the batch it came in nor on the task split.
        let group = self.n_head / self.n_head_kv;
        let q = &q;
        let queries_of = |g: usize, rows: Range<usize>| -> Vec<(usize, &[f32])> {
            rows.flat_map(|i| {
                (g * group..(g + 1) * group)
                    .map(move |h| (start_pos + i + 1, &q[(i * self.n_head + h) * hd..][..hd]))
            })
            .collect()
        };
        let max_len = start_pos + n;
        if n <= QUERY_BLOCK_ROWS && max_len > VALUE_CHUNK && self.n_head_kv < pool.n_threads() {
            // Few rows over a long context, fewer kv heads than threads: each head's positions
            // are shared out by chunk too, so every core streams part of the cache.
            let groups: Vec<Vec<(usize, &[f32])>> =
                (0..self.n_head_kv).map(|g| queries_of(g, 0..n)).collect();
            let outs = attend_by_chunks(&groups, &*kv, hd, pool);
            for (g, out) in outs.iter().enumerate() {
                for (i, row_heads) in out.chunks_exact(group * hd).enumerate() {
                    let dst = (i * self.n_head + g * group) * hd;
                    attn[dst..dst + group * hd].copy_from_slice(row_heads);
                }
            }
        } else {
            // Tasks are (KV group, block of rows): a group's heads share each tile of its keys
            // and values, and a prefill's rows spread over the pool even when groups are few.
            let row_blocks = pool.n_threads().div_ceil(self.n_head_kv).min(n).max(1);
            let rows_per_block = n.div_ceil(row_blocks);
            let n_tasks = self.n_head_kv * row_blocks;
            let outputs: Vec<Mutex<Vec<f32>>> =
                (0..n_tasks).map(|_| Mutex::new(Vec::new())).collect();
            let kv_ref = &*kv;
            pool.run(n_tasks, |task, _| {
                let (g, block) = (task / row_blocks, task % row_blocks);
                let rows = block * rows_per_block..((block + 1) * rows_per_block).min(n);
                if rows.is_empty() {
                    return;
                }
                let mut out = outputs[task].lock().unwrap_or_else(|e| e.into_inner());
                out.resize(rows.len() * group * hd, 0.0);
                // Keys and values come tile by tile, widened to f32 from the cache's type as
                // they are read, so a long context is read once per block of queries at its
                // stored size.
                let read = |values: bool, positions: Range<usize>, dst: &mut [f32]| {
                    kv_ref.read_head(values, g, positions, dst)
                };
                // Rows go in blocks so that each tile of keys and values is read from cache by
                // all the block's queries; every query still sees its positions in ascending
                // order.
                let first = rows.start;
                with_scratch(|scratch| {
                    for block in rows.clone().step_by(QUERY_BLOCK_ROWS) {
                        let block = block..(block + QUERY_BLOCK_ROWS).min(rows.end);
                        let queries = queries_of(g, block.clone());
                        let o_first = (block.start - first) * group * hd;
                        let o = &mut out[o_first..o_first + queries.len() * hd];
                        attend_tiled(&queries, &read, hd, scratch, o);
                    }
                });
            });
            for (task, out) in outputs.into_iter().enumerate() {
                let (g, block) = (task / row_blocks, task % row_blocks);
                let out = out.into_inner().unwrap_or_else(|e| e.into_inner());
                let first = block * rows_per_block;
                for (r, row_heads) in out.chunks_exact(group * hd).enumerate() {
                    let dst = ((first + r) * self.n_head + g * group) * hd;
                    attn[dst..dst + group * hd].copy_from_slice(row_heads);
                }
            }
        }
        for (a, &g) in attn.iter_mut().zip(&gate) {
            *a *= ops::sigmoid(g);
        }
        Ok(())
    }
}

/// Rows per block of queries in one tiled attention pass.
const QUERY_BLOCK_ROWS: usize = 8;
/// Cached positions per tile: 64 positions × 256 dims × 4 bytes = 64 KiB of keys or values.
const KEY_TILE: usize = 64;
/// Cached positions per chunk of a query's weighted value sum. A query's output is the sum, in
/// position order, of its chunks' sums, each added up from zero in ascending position; chunks are
/// fixed in absolute positions (a multiple of [`KEY_TILE`] and of the softmax's eight lanes), so
/// a row's result depends neither on its batch nor on how chunks are spread over threads, and a
/// context within one chunk is summed exactly as one run.
const VALUE_CHUNK: usize = 1024;

/// Reads positions of one kv head's keys (`false`) or values (`true`) as f32, `[pos][head_dim]`.
type TileReader<'a> = dyn Fn(bool, Range<usize>, &mut [f32]) + Sync + 'a;

/// Buffers of one attention task, reused across its blocks of queries and, per thread, across
/// passes.
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    tile: Vec<f32>,
    chunk_sum: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// `f` with this thread's scratch buffers (fresh ones if they are already in use).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    // The scores of a long context are megabytes: buffers kept per thread avoid fresh zeroed
    // pages (and their faults) in every pass.
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut kept) => f(&mut kept),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Where the positions of `range` sit in a buffer of per-query rows: position p of query j at
/// `j * stride + p - base`.
#[derive(Clone)]
struct Span {
    range: Range<usize>,
    base: usize,
    stride: usize,
}

impl Span {
    /// Query j's slots for positions `from..to`.
    fn at(&self, j: usize, from: usize, to: usize) -> Range<usize> {
        j * self.stride + from - self.base..j * self.stride + to - self.base
    }

    /// The slots of query j (of length `len`) for the positions of the span it sees, if any.
    fn seen(&self, j: usize, len: usize) -> Option<Range<usize>> {
        let end = self.range.end.min(len);
        (end > self.range.start).then(|| self.at(j, self.range.start, end))
    }
}

crate::simd::avx2_and_baseline! {
baseline = attend_tiled_baseline;
/// Softmax attention of several query heads, each `(len, q)` over the first `len` cached
/// positions, into `o` (`queries.len() × hd`). Key and value tiles are read once for all
/// queries. For each query the arithmetic is that of a lone query: scores `q·k_p · scale` in
/// position order, one softmax over its `len` scores ([`softmax_scores`]), then its weighted
/// values summed chunk by chunk ([`VALUE_CHUNK`]).
fn attend_tiled(
    queries: &[(usize, &[f32])],
    read: &TileReader<'_>,
    hd: usize,
    scratch: &mut Scratch,
    o: &mut [f32],
) {
    let max_len = queries.iter().map(|&(len, _)| len).max().unwrap_or(0);
    let Scratch { scores, tile, chunk_sum } = scratch;
    // Every score a query reads (positions below its length) is written first, so the buffer
    // only grows and is never cleared.
    if scores.len() < queries.len() * max_len {
        scores.resize(queries.len() * max_len, 0.0);
    }
    let all = Span { range: 0..max_len, base: 0, stride: max_len };
    score_positions(queries, read, hd, &all, tile, scores);
    for (j, &(len, _)) in queries.iter().enumerate() {
        softmax_scores(&mut scores[all.at(j, 0, len)]);
    }
    o.fill(0.0);
    if max_len <= VALUE_CHUNK {
        add_values(queries, read, hd, &all, tile, scores, o);
        return;
    }
    chunk_sum.resize(o.len(), 0.0);
    for start in (0..max_len).step_by(VALUE_CHUNK) {
        let chunk = Span { range: start..(start + VALUE_CHUNK).min(max_len), ..all.clone() };
        chunk_sum.fill(0.0);
        add_values(queries, read, hd, &chunk, tile, scores, chunk_sum);
        o.iter_mut().zip(chunk_sum.iter()).for_each(|(a, &b)| *a += b);
    }
}
}

/// Raw scores `q·k_p · scale` of every query at the positions of `span` below its length, into
/// `scores` as `span` lays them out. `span.range` starts on a [`KEY_TILE`] boundary.
#[inline(always)]
fn score_positions(
    queries: &[(usize, &[f32])],
    read: &TileReader<'_>,
    hd: usize,
    span: &Span,
    buf: &mut Vec<f32>,
    scores: &mut [f32],
) {
    let scale = 1.0 / (hd as f32).sqrt();
    buf.resize(KEY_TILE * hd, 0.0);
    for tile in span.range.clone().step_by(KEY_TILE) {
        let tile_end = (tile + KEY_TILE).min(span.range.end);
        read(false, tile..tile_end, &mut buf[..(tile_end - tile) * hd]);
        let keys = &buf[..(tile_end - tile) * hd];
        // Queries go in pairs, each key chunk loaded once for both (the heads of one row, or
        // of neighbouring rows, whose lengths differ by a few positions at most); each query's
        // arithmetic is that of a lone query either way.
        for j in (0..queries.len()).step_by(2) {
            let (len_a, qa) = queries[j];
            let end_a = tile_end.min(len_a).max(tile);
            let Some(&(len_b, qb)) = queries.get(j + 1) else {
                score_alone(qa, keys, scale, &mut scores[span.at(j, tile, end_a)]);
                continue;
            };
            let end_b = tile_end.min(len_b).max(tile);
            let both = end_a.min(end_b);
            // Query j + 1's slots come after query j's.
            let (row_a, row_b) = scores.split_at_mut(span.at(j + 1, tile, tile).start);
            let (row_a, row_b) = (
                &mut row_a[span.at(j, tile, end_a)],
                &mut row_b[..end_b - tile],
            );
            let shared = both - tile;
            score_keys(
                [qa, qb],
                &keys[..shared * hd],
                scale,
                [&mut row_a[..shared], &mut row_b[..shared]],
            );
            let rest = &keys[shared * hd..];
            score_alone(qa, rest, scale, &mut row_a[shared..]);
            score_alone(qb, rest, scale, &mut row_b[shared..]);
        }
    }
}

/// [`score_keys`] for one query over the first `out.len()` keys of `keys`: the query twice,
/// one copy's scores kept (a few positions at the end of a tile, or an odd query out).
#[inline(always)]
fn score_alone(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    let hd = q.len();
    let mut spare = [0.0f32; KEY_TILE];
    for (o, k) in out.chunks_mut(KEY_TILE).zip(keys.chunks(KEY_TILE * hd)) {
        let n = o.len();
        score_keys([q, q], &k[..n * hd], scale, [o, &mut spare[..n]]);
    }
}

/// `o_j += Σ_p w_j[p]·v_p` over the positions of `span` below each query's length, in ascending
/// p, with the weights `w` laid out as `span` says. `span.range` starts on a [`KEY_TILE`]
/// boundary.
#[inline(always)]
fn add_values(
    queries: &[(usize, &[f32])],
    read: &TileReader<'_>,
    hd: usize,
    span: &Span,
    buf: &mut Vec<f32>,
    w: &[f32],
    o: &mut [f32],
) {
    buf.resize(KEY_TILE * hd, 0.0);
    for tile in span.range.clone().step_by(KEY_TILE) {
        let tile_end = (tile + KEY_TILE).min(span.range.end);
        read(true, tile..tile_end, &mut buf[..(tile_end - tile) * hd]);
        // Four queries at a time (the heads of one row, or of neighbouring rows) share each
        // load of a value chunk over the positions all of them see; with four, sixteen columns
        // of each are eight independent running sums, enough to keep the adds from waiting on
        // each other. A query's positions past the shared ones follow alone, so each element
        // still adds its terms in ascending position.
        for j in (0..queries.len()).step_by(4) {
            let run = (queries.len() - j).min(4);
            let end_of = |q: usize| tile_end.min(queries[j + q].0).max(tile);
            let shared = (0..run).map(end_of).min().unwrap_or(tile);
            if shared > tile {
                let v = &buf[..(shared - tile) * hd];
                let s = |q: usize| &w[span.at(j + q, tile, shared)];
                let o = &mut o[j * hd..(j + run) * hd];
                match run {
                    4 => add_weighted_values([s(0), s(1), s(2), s(3)], v, o),
                    3 => add_weighted_values([s(0), s(1), s(2)], v, o),
                    2 => add_weighted_values([s(0), s(1)], v, o),
                    _ => add_weighted_values([s(0)], v, o),
                }
            }
            for q in 0..run {
                let end = end_of(q);
                if end > shared {
                    let v = &buf[(shared - tile) * hd..(end - tile) * hd];
                    let o = &mut o[(j + q) * hd..(j + q + 1) * hd];
                    add_weighted_values([&w[span.at(j + q, shared, end)]], v, o);
                }
            }
        }
    }
}

/// One chunk of the positions of every query of one kv group, for [`attend_by_chunks`].
#[derive(Default)]
struct ChunkWork {
    /// Scores, then `e^(s − max)`, then softmax weights, `[query][position in chunk]`.
    scores: Vec<f32>,
    /// Each query's largest score in the chunk.
    max: Vec<f32>,
    /// Each query's terms of the softmax's sum in the chunk, in order ([`exp_shifted`]).
    terms: Vec<Vec<f32>>,
    /// Each query's weighted value sum over the chunk, `[query][hd]`.
    sum: Vec<f32>,
}

/// Attention of a few rows' queries over a long context, shared out over the pool by kv group
/// and by [`VALUE_CHUNK`] of positions: a job for the scores and each chunk's maximum, a job for
/// the exponentials, then one for each chunk's weighted values, which are merged in position
/// order. Every query's arithmetic is [`attend_tiled`]'s (the same scores, the softmax's terms
/// summed in the same order, the same chunk sums), so the result has the same bits. `groups[g]`
/// are group g's queries; the result is each group's outputs, `[query][hd]`.
fn attend_by_chunks(
    groups: &[Vec<(usize, &[f32])>],
    kv: &KvLayer,
    hd: usize,
    pool: &ThreadPool,
) -> Vec<Vec<f32>> {
    let max_len = groups
        .iter()
        .flatten()
        .map(|&(len, _)| len)
        .max()
        .unwrap_or(0);
    let n_chunks = max_len.div_ceil(VALUE_CHUNK);
    let n_tasks = groups.len() * n_chunks;
    let work: Vec<Mutex<ChunkWork>> = (0..n_tasks).map(|_| Mutex::default()).collect();
    let task_of = |task: usize| {
        let (g, c) = (task / n_chunks, task % n_chunks);
        let start = c * VALUE_CHUNK;
        let span = Span {
            range: start..(start + VALUE_CHUNK).min(max_len),
            base: start,
            stride: VALUE_CHUNK,
        };
        let read = move |values: bool, positions: Range<usize>, dst: &mut [f32]| {
            kv.read_head(values, g, positions, dst)
        };
        (g, span, read)
    };
    let lock = |task: usize| work[task].lock().unwrap_or_else(|e| e.into_inner());

    pool.run(n_tasks, |task, _| {
        let (g, span, read) = task_of(task);
        let mut w = lock(task);
        let queries = &groups[g];
        w.scores.resize(queries.len() * VALUE_CHUNK, 0.0);
        with_scratch(|scratch| chunk_scores(queries, &read, hd, &span, &mut scratch.tile, &mut w));
    });
    let max: Vec<Vec<f32>> = groups
        .iter()
        .enumerate()
        .map(|(g, queries)| {
            (0..queries.len())
                .map(|j| {
                    (0..n_chunks)
                        .map(|c| lock(g * n_chunks + c).max[j])
                        .fold(f32::NEG_INFINITY, f32::max)
                })
                .collect()
        })
        .collect();
    pool.run(n_tasks, |task, _| {
        let (g, span, _) = task_of(task);
        chunk_exps(&groups[g], &span, &max[g], &mut lock(task));
    });
    let inv: Vec<Vec<f32>> = groups
        .iter()
        .enumerate()
        .map(|(g, queries)| {
            (0..queries.len())
                .map(|j| {
                    let mut sum = 0.0f64;
                    for c in 0..n_chunks {
                        lock(g * n_chunks + c).terms[j]
                            .iter()
                            .for_each(|&t| sum += t as f64);
                    }
                    (1.0 / sum) as f32
                })
                .collect()
        })
        .collect();
    pool.run(n_tasks, |task, _| {
        let (g, span, read) = task_of(task);
        let mut w = lock(task);
        with_scratch(|scratch| {
            chunk_values(
                &groups[g],
                &read,
                hd,
                &span,
                &inv[g],
                &mut scratch.tile,
                &mut w,
            )
        });
    });
    groups
        .iter()
        .enumerate()
        .map(|(g, queries)| {
            let mut o = vec![0.0f32; queries.len() * hd];
            for c in 0..n_chunks {
                o.iter_mut()
                    .zip(&lock(g * n_chunks + c).sum)
                    .for_each(|(a, &b)| *a += b);
            }
            o
        })
        .collect()
}

crate::simd::avx2_and_baseline! {
baseline = chunk_scores_baseline;
/// The scores of one chunk's positions and each query's largest one there.
fn chunk_scores(
    queries: &[(usize, &[f32])],
    read: &TileReader<'_>,
    hd: usize,
    span: &Span,
    buf: &mut Vec<f32>,
    w: &mut ChunkWork,
) {
    score_positions(queries, read, hd, span, buf, &mut w.scores);
    w.max.clear();
    for (j, &(len, _)) in queries.iter().enumerate() {
        let seen = span.seen(j, len);
        w.max.push(seen.map_or(f32::NEG_INFINITY, |s| lanes_max(&w.scores[s])));
    }
}
}

crate::simd::avx2_and_baseline! {
baseline = chunk_exps_baseline;
/// `e^(s − max)` of one chunk's scores and each query's terms of the softmax's sum there.
fn chunk_exps(queries: &[(usize, &[f32])], span: &Span, max: &[f32], w: &mut ChunkWork) {
    let ChunkWork { scores, terms, .. } = w;
    terms.resize_with(queries.len(), Vec::new);
    for (j, &(len, _)) in queries.iter().enumerate() {
        let t = &mut terms[j];
        t.clear();
        if let Some(seen) = span.seen(j, len) {
            exp_shifted(&mut scores[seen], max[j], |x| t.push(x));
        }
    }
}
}

crate::simd::avx2_and_baseline! {
baseline = chunk_values_baseline;
/// The softmax weights of one chunk (its exponentials times each query's `inv`) and each
/// query's weighted value sum over the chunk, from zero.
fn chunk_values(
    queries: &[(usize, &[f32])],
    read: &TileReader<'_>,
    hd: usize,
    span: &Span,
    inv: &[f32],
    buf: &mut Vec<f32>,
    w: &mut ChunkWork,
) {
    let ChunkWork { scores, sum, .. } = w;
    for (j, &(len, _)) in queries.iter().enumerate() {
        if let Some(seen) = span.seen(j, len) {
            scores[seen].iter_mut().for_each(|v| *v *= inv[j]);
        }
    }
    sum.clear();
    sum.resize(queries.len() * hd, 0.0);
    add_values(queries, read, hd, span, buf, scores, sum);
}
}

/// In-place softmax of one query's scores: the maximum over eight fixed lanes ([`lanes_max`]),
/// `e^(x − max)` with the sum's terms added up in f64 in order ([`exp_shifted`]), then one
/// multiply by the sum's inverse. Every step is element-wise or in fixed lanes, so the compiler
/// vectorises it and the result does not depend on which copy runs.
#[inline(always)]
fn softmax_scores(x: &mut [f32]) {
    let max = lanes_max(x);
    let mut sum = 0.0f64;
    exp_shifted(x, max, |t| sum += t as f64);
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The largest of `x`, over eight fixed lanes and then the tail.
#[inline(always)]
fn lanes_max(x: &[f32]) -> f32 {
    let wide = x.len() / 8 * 8;
    let mut lanes = [f32::NEG_INFINITY; 8];
    for c in x[..wide].chunks_exact(8) {
        for l in 0..8 {
            lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
        }
    }
    let mut max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &v in &x[wide..] {
        max = max.max(v);
    }
    max
}

/// `x ← e^(x − max)` by [`simd::exp_nonpositive`], handing `term` the softmax sum's terms in
/// order: each group of eight summed in a fixed pairwise order, then the tail one by one. `x`
/// starts at a multiple of eight positions, so the groups of consecutive slices of one query's
/// scores are the groups of the whole.
#[inline(always)]
fn exp_shifted(x: &mut [f32], max: f32, mut term: impl FnMut(f32)) {
    // The exponentials first, as one element-wise loop the compiler vectorises, then the
    // terms from them: the same values as computing each group's terms as it goes.
    x.iter_mut()
        .for_each(|v| *v = simd::exp_nonpositive(*v - max));
    let wide = x.len() / 8 * 8;
    for c in x[..wide].chunks_exact(8) {
        term(((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7])));
    }
    x[wide..].iter().for_each(|&v| term(v));
}

/// Scores `ops::dot(q_i, k_p) · scale` of two queries over consecutive keys (`keys` holds
/// `out[i].len()` rows of `q_i.len()`), into `out[i][p]`. Each score has exactly `ops::dot`'s
/// operations (eight lane sums over chunks of eight, the same pairwise reduction, then the
/// tail) and then one multiply by `scale`, so it is the bits a lone query's plain loop gives.
/// With AVX2 and a head size that is a multiple of eight, four keys go per pass over both
/// queries (each key chunk loaded once for both) and the eight lane reductions are done
/// together in registers ([`reduce_lanes_x8_avx2`]); otherwise [`score_keys_scalar`].
#[inline(always)]
fn score_keys(q: [&[f32]; 2], keys: &[f32], scale: f32, out: [&mut [f32]; 2]) {
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx2() && q[0].len().is_multiple_of(8) {
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { score_keys_avx2(q, keys, scale, out) };
        return;
    }
    score_keys_scalar(q, keys, scale, out)
}

/// The scalar reference of [`score_keys`].
#[inline(always)]
fn score_keys_scalar(q: [&[f32]; 2], keys: &[f32], scale: f32, out: [&mut [f32]; 2]) {
    let hd = q[0].len();
    for (qi, oi) in q.iter().zip(out) {
        for (p, s) in oi.iter_mut().enumerate() {
            *s = ops::dot(qi, &keys[p * hd..(p + 1) * hd]) * scale;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn score_keys_avx2(q: [&[f32]; 2], keys: &[f32], scale: f32, out: [&mut [f32]; 2]) {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_castps256_ps128, _mm256_extractf128_ps, _mm256_loadu_ps,
        _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm_storeu_ps,
    };
    let hd = q[0].len();
    let n = out[0].len();
    assert!(hd.is_multiple_of(8) && q[1].len() == hd && out[1].len() == n && keys.len() >= n * hd);
    let [out_a, out_b] = out;
    let mut p = 0;
    // SAFETY: every load is of 8 floats at c·8 < hd within both queries, and at
    // (p + r)·hd + c·8 with p + r < n within the keys; every store is of 4 floats at p + 4 <= n
    // within both outputs (all checked above).
    unsafe {
        let scale_v = _mm256_set1_ps(scale);
        while p + 4 <= n {
            // a[r]: query a's lane sums over key p + r; a[4 + r]: query b's.
            let mut a: [__m256; 8] = [_mm256_setzero_ps(); 8];
            for at in (0..hd).step_by(8) {
                let qa = _mm256_loadu_ps(q[0].as_ptr().add(at));
                let qb = _mm256_loadu_ps(q[1].as_ptr().add(at));
                for r in 0..4 {
                    let kv = _mm256_loadu_ps(keys.as_ptr().add((p + r) * hd + at));
                    a[r] = _mm256_add_ps(a[r], _mm256_mul_ps(qa, kv));
                    a[4 + r] = _mm256_add_ps(a[4 + r], _mm256_mul_ps(qb, kv));
                }
            }
            let s = _mm256_mul_ps(reduce_lanes_x8_avx2(a), scale_v);
            _mm_storeu_ps(out_a.as_mut_ptr().add(p), _mm256_castps256_ps128(s));
            _mm_storeu_ps(out_b.as_mut_ptr().add(p), _mm256_extractf128_ps(s, 1));
            p += 4;
        }
    }
    score_keys_scalar(
        q,
        &keys[p * hd..],
        scale,
        [&mut out_a[p..], &mut out_b[p..]],
    );
}

/// `ops::dot`'s pairwise reduction of eight registers of lane sums at once: lane r of the
/// result is `((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))` of `v[r]`. The same adds of
/// the same operands as the scalar form, rearranged across registers: the halves' sums
/// (`a_l + a_{l+4}`) for two registers per add, then two rounds of horizontal pair sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn reduce_lanes_x8_avx2(v: [std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::{_mm256_add_ps, _mm256_hadd_ps, _mm256_permute2f128_ps};
    // h[r] lanes 0..4: x_l = a_l + a_{l+4} of v[r]; lanes 4..8: those of v[r + 4].
    let h: [_; 4] = core::array::from_fn(|r| {
        let lo = _mm256_permute2f128_ps::<0x20>(v[r], v[r + 4]);
        let hi = _mm256_permute2f128_ps::<0x31>(v[r], v[r + 4]);
        _mm256_add_ps(lo, hi)
    });
    // Lanes (x0 + x1, x2 + x3) of v[0], then of v[1] | of v[4], then of v[5].
    let g01 = _mm256_hadd_ps(h[0], h[1]);
    // Likewise for v[2], v[3] | v[6], v[7].
    let g23 = _mm256_hadd_ps(h[2], h[3]);
    // (x0 + x1) + (x2 + x3) of v[0], v[1], v[2], v[3] | v[4], v[5], v[6], v[7].
    _mm256_hadd_ps(g01, g23)
}

/// `o_q += Σ_p s_q[p]·v_p` for each of `N` queries over the same consecutive value rows `v`
/// (`s_q.len()` rows of `hd`; `o` holds the `N` outputs, `N × hd`). Each element adds its terms
/// in ascending p as a row-by-row loop over one query would, so the result does not depend on
/// how many queries share the pass. Sixteen columns of every query stay in registers across all
/// the rows, and each value chunk is loaded once for all `N`.
#[inline(always)]
fn add_weighted_values<const N: usize>(s: [&[f32]; N], v: &[f32], o: &mut [f32]) {
    let hd = o.len() / N;
    let rows = s[0].len();
    assert!(s.iter().all(|sq| sq.len() == rows) && v.len() >= rows * hd);
    let wide = hd / 16 * 16;
    for c in (0..wide).step_by(16) {
        let mut acc = [[0.0f32; 16]; N];
        for (q, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&o[q * hd + c..q * hd + c + 16]);
        }
        for p in 0..rows {
            let vp: &[f32; 16] = v[p * hd + c..p * hd + c + 16]
                .try_into()
                .expect("sixteen columns");
            for (a, sq) in acc.iter_mut().zip(&s) {
                let x = sq[p];
                for l in 0..16 {
                    a[l] += x * vp[l];
                }
            }
        }
        for (q, a) in acc.iter().enumerate() {
            o[q * hd + c..q * hd + c + 16].copy_from_slice(a);
        }
    }
    for (q, sq) in s.iter().enumerate() {
        let oq = &mut o[q * hd..(q + 1) * hd];
        for (p, &x) in sq.iter().enumerate() {
            for d in wide..hd {
                oq[d] += x * v[p * hd + d];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy the CPU runs (AVX2 where available) and the baseline copy of tiled attention
    /// give the same bits, for queries of different lengths across several key tiles.
    #[test]
    fn attention_copies_agree_bit_for_bit() {
        crate::simd::report_missing_avx2("the AVX2 copy of attention");
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        // Short contexts (one value chunk) and one over several chunks.
        for (hd, n_pos) in [
            (64usize, 3 * KEY_TILE + 5),
            (256, 3 * KEY_TILE + 5),
            (100, 3 * KEY_TILE + 5),
            (64, 2 * VALUE_CHUNK + KEY_TILE + 5),
        ] {
            let keys: Vec<f32> = (0..n_pos * hd).map(|_| next()).collect();
            let vals: Vec<f32> = (0..n_pos * hd).map(|_| next()).collect();
            // Runs of one to four equal lengths (the heads of one row) share value loads.
            let mut lens = vec![
                1,
                KEY_TILE,
                KEY_TILE,
                KEY_TILE + 1,
                KEY_TILE + 1,
                KEY_TILE + 1,
                KEY_TILE + 1,
                KEY_TILE + 1,
                n_pos - 1,
                n_pos - 1,
                n_pos - 1,
                n_pos,
            ];
            if n_pos > VALUE_CHUNK {
                lens.extend([
                    VALUE_CHUNK,
                    VALUE_CHUNK + 1,
                    VALUE_CHUNK + 1,
                    2 * VALUE_CHUNK,
                ]);
            }
            let qs: Vec<Vec<f32>> = (0..lens.len())
                .map(|_| (0..hd).map(|_| next()).collect())
                .collect();
            let queries: Vec<(usize, &[f32])> =
                lens.iter().zip(&qs).map(|(&l, q)| (l, &q[..])).collect();
            let (mut o_a, mut o_b) = (vec![0.0; lens.len() * hd], vec![0.0; lens.len() * hd]);
            let read = |values: bool, positions: Range<usize>, dst: &mut [f32]| {
                let src = if values { &vals } else { &keys };
                dst.copy_from_slice(&src[positions.start * hd..positions.end * hd]);
            };
            let (mut sc_a, mut sc_b) = (Scratch::default(), Scratch::default());
            attend_tiled(&queries, &read, hd, &mut sc_a, &mut o_a);
            attend_tiled_baseline(&queries, &read, hd, &mut sc_b, &mut o_b);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&o_a), bits(&o_b), "head dim {hd}");
            // And both are a lone query's plain loops, bit for bit: the weighted values summed
            // in ascending position within each chunk, the chunks' sums added in order.
            for (j, &(len, q)) in queries.iter().enumerate() {
                let mut s: Vec<f32> = (0..len)
                    .map(|p| ops::dot(q, &keys[p * hd..(p + 1) * hd]) * (1.0 / (hd as f32).sqrt()))
                    .collect();
                softmax_scores(&mut s);
                let mut o = vec![0.0f32; hd];
                for chunk in (0..len).step_by(VALUE_CHUNK) {
                    let mut part = vec![0.0f32; hd];
                    for p in chunk..(chunk + VALUE_CHUNK).min(len) {
                        for d in 0..hd {
                            part[d] += s[p] * vals[p * hd + d];
                        }
                    }
                    for d in 0..hd {
                        o[d] += part[d];
                    }
                }
                assert_eq!(
                    bits(&o),
                    bits(&o_a[j * hd..(j + 1) * hd]),
                    "query {j}, head dim {hd}"
                );
            }
        }
    }

    /// Few queries over a long context shared out by kv group and value chunk over any number
    /// of threads give the bits of one task per group ([`attend_tiled`], both copies).
    #[test]
    fn chunks_over_threads_equal_one_task() {
        use crate::cache::{KvLayer, KvType};
        let (hd, heads, n_pos) = (64usize, 2usize, 2 * VALUE_CHUNK + KEY_TILE + 13);
        let mut kv = KvLayer::new(KvType::F16, KvType::F16, heads, hd);
        let row = |p: usize, salt: usize| -> Vec<f32> {
            (0..heads * hd)
                .map(|i| (((p * 131 + i * 71 + salt) % 1009) as f32 / 1009.0 - 0.5) * 3.0)
                .collect()
        };
        for p in 0..n_pos {
            kv.push(&row(p, 0), &row(p, 7));
        }
        let qs: Vec<Vec<f32>> = (0..heads * 6)
            .map(|h| {
                (0..hd)
                    .map(|d| ((h * 37 + d * 13) % 29) as f32 / 29.0 - 0.5)
                    .collect()
            })
            .collect();
        // Three rows ending at the last positions, two query heads per kv head.
        let groups: Vec<Vec<(usize, &[f32])>> = (0..heads)
            .map(|g| {
                (0..3)
                    .flat_map(|i| (0..2).map(move |h| (i, h)))
                    .map(|(i, h)| (n_pos - 2 + i, &qs[g * 6 + i * 2 + h][..]))
                    .collect()
            })
            .collect();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let one_task: Vec<Vec<u32>> = groups
            .iter()
            .enumerate()
            .map(|(g, queries)| {
                let read = |values: bool, positions: Range<usize>, dst: &mut [f32]| {
                    kv.read_head(values, g, positions, dst)
                };
                let mut o = vec![0.0; queries.len() * hd];
                attend_tiled(queries, &read, hd, &mut Scratch::default(), &mut o);
                let mut o_base = vec![0.0; queries.len() * hd];
                attend_tiled_baseline(queries, &read, hd, &mut Scratch::default(), &mut o_base);
                assert_eq!(bits(&o), bits(&o_base));
                bits(&o)
            })
            .collect();
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads);
            let split = attend_by_chunks(&groups, &kv, hd, &pool);
            for (g, o) in split.iter().enumerate() {
                assert_eq!(bits(o), one_task[g], "{threads} threads, group {g}");
            }
        }
    }

    /// The softmax of the scores is the exact one to within a few ulp, sums to one, and keeps
    /// the largest score's weight for a query that sees one position.
    #[test]
    fn softmax_scores_matches_the_exact_softmax() {
        for n in [1usize, 7, 8, 9, 64, 1000] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1013) as f32 * 0.05 - 30.0)
                .collect();
            let mut fast = x.clone();
            softmax_scores(&mut fast);
            // The shifted score is an f32 difference in both; the exponential is what may differ.
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e = |v: f32| ((v - max) as f64).exp();
            let total: f64 = x.iter().map(|&v| e(v)).sum();
            for (&v, &f) in x.iter().zip(&fast) {
                let exact = e(v) / total;
                assert!(
                    (f as f64 - exact).abs() <= 4e-7 * exact + 1e-30,
                    "n {n}: {f} vs {exact}"
                );
            }
        }
        let mut one = vec![3.5f32];
        softmax_scores(&mut one);
        assert_eq!(one, [1.0]);
    }

    /// Quantized and half-float caches give attention over exactly the values they store:
    /// reading a head's tile equals dequantizing the whole row with the reference code.
    #[test]
    fn tiles_of_every_kv_type_equal_the_reference_dequantization() {
        use crate::cache::{KvLayer, KvType};
        let (hd, heads, n_pos) = (64usize, 2usize, 70usize);
        let width = hd * heads;
        let rows: Vec<Vec<f32>> = (0..n_pos)
            .map(|p| {
                (0..width)
                    .map(|i| ((p * 31 + i * 17) % 97) as f32 / 13.0 - 3.5)
                    .collect()
            })
            .collect();
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0, KvType::Q4_0] {
            let mut kv = KvLayer::new(ty, ty, heads, hd);
            for r in &rows {
                kv.push(r, r);
            }
            let reference = |p: usize| -> Vec<f32> {
                use nextn_quant::formats::{legacy, BlockQ4_0, BlockQ8_0};
                let r = &rows[p];
                let mut out = vec![0.0f32; width];
                match ty {
                    KvType::F32 => out.copy_from_slice(r),
                    KvType::F16 => {
                        for (o, &x) in out.iter_mut().zip(r) {
                            *o = half::f16::from_f32(x).to_f32();
                        }
                    }
                    KvType::Q8_0 => {
                        let mut b = vec![BlockQ8_0::default(); width / 32];
                        legacy::quantize_row_q8_0(r, &mut b).unwrap();
                        legacy::dequantize_row_q8_0(&b, &mut out).unwrap();
                    }
                    KvType::Q4_0 => {
                        let mut b = vec![BlockQ4_0::default(); width / 32];
                        legacy::quantize_row_q4_0(r, &mut b).unwrap();
                        legacy::dequantize_row_q4_0(&b, &mut out).unwrap();
                    }
                }
                out
            };
            for head in 0..heads {
                let mut tile = vec![0.0f32; 9 * hd];
                kv.read_head(true, head, 61..70, &mut tile);
                for (k, p) in (61..70).enumerate() {
                    assert_eq!(
                        tile[k * hd..(k + 1) * hd],
                        reference(p)[head * hd..(head + 1) * hd],
                        "{ty:?}, head {head}, position {p}"
                    );
                }
            }
        }
    }

    type ScoreKeys = fn([&[f32]; 2], &[f32], f32, [&mut [f32]; 2]);

    /// The AVX2 scores of two queries are the scalar ones, bit for bit, and each is a lone
    /// query's `ops::dot` times the scale, for head sizes with and without a tail and key
    /// counts with and without a remainder of four.
    #[test]
    fn score_keys_copies_agree_bit_for_bit() {
        crate::simd::report_missing_avx2("the AVX2 copy of the attention scores");
        for hd in [8usize, 31, 64, 256, 100] {
            for n_keys in [0usize, 1, 4, 7, 64] {
                let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.37).sin()).collect();
                let q2: Vec<f32> = q.iter().map(|x| x * -1.5 + 0.25).collect();
                let keys: Vec<f32> = (0..n_keys * hd)
                    .map(|i| ((i + 7 * (i / hd)) as f32 * 0.11).cos())
                    .collect();
                let scale = 1.0 / (hd as f32).sqrt();
                let run = |f: ScoreKeys| {
                    let (mut a, mut b) = (vec![0.0f32; n_keys], vec![0.0f32; n_keys]);
                    f([&q, &q2], &keys, scale, [&mut a, &mut b]);
                    [a, b].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                };
                let (fast, scalar) = (run(score_keys), run(score_keys_scalar));
                assert_eq!(fast, scalar, "head size {hd}, {n_keys} keys");
                for p in 0..n_keys {
                    let key = &keys[p * hd..(p + 1) * hd];
                    assert_eq!(fast[0][p], (ops::dot(&q, key) * scale).to_bits());
                    assert_eq!(fast[1][p], (ops::dot(&q2, key) * scale).to_bits());
                }
            }
        }
    }
}
