//! The forward pass on a GPU (`-dev`, `-ngl`): the same trunk, NextN head, verify and commit as
//! the CPU path, over `nextn-gpu`'s kernels, with every weight and every cache on the device.
//!
//! `Model::offload` uploads the trunk; from then on `Model::forward_batch`, `Model::commit` and
//! `Model::new_sequence` run here, and `NextnHead::load` uploads the head beside it. The engine
//! does not know which path runs. The passes of a step are recorded into one submission with one
//! read-back. Token embeddings are gathered on the device when the table is there (the LM head of a
//! tied model, or the table a head that drafts on the device uploaded); otherwise the host gathers
//! them from its table and uploads the rows. What comes back is what the sampler and the head
//! need: the logits (or only the top-1) of the rows asked for, the tokens the head drafted on the
//! device, and every row's post-norm hidden state (`n × n_embd` floats) that seeds the head.

mod cache;
mod layer;
mod nextn;

use std::sync::{Arc, Mutex};

use nextn_gpu::kernels::matvec::{embed_rows, product, Acts, Epilogue};
use nextn_gpu::kernels::norm::{norm_quant, NormOut};
use nextn_gpu::weights::DeviceMatrix;
use nextn_gpu::{Gpu, GpuError, ReadBack, ReadSlot, Recorder};
use nextn_quant::kernels::ThreadPool;

pub use cache::{DeviceDeltaNetCache, DeviceKvCache};
pub(crate) use layer::{DeviceLayer, HostExperts};
pub(crate) use nextn::DeviceHead;

use crate::batch::{
    is_device_token, BatchItem, ForwardOutput, LogitRows, Readback, RowTop1, Segment, DEVICE_TOKEN,
    DEVICE_TOKENS,
};
use crate::cache::{KvType, LayerCache};
use crate::ffn::Ffn;
use crate::model::Model;
use crate::ops::RowPositions;
use crate::placement::Placement;
use crate::weights::Linear;
use crate::ModelError;

pub(crate) fn gpu_err(e: GpuError) -> ModelError {
    match e {
        GpuError::OutOfMemory { .. }
        | GpuError::OverBudget { .. }
        | GpuError::BufferTooLarge { .. } => ModelError::DeviceMemory(e),
        e => ModelError::Device(e.to_string()),
    }
}

/// A weight matrix on the device with the tensor's scale.
pub(crate) struct Mat {
    pub(crate) m: DeviceMatrix,
    pub(crate) scale: Option<f32>,
}

impl Mat {
    pub(crate) fn upload(gpu: &Gpu, l: &Linear) -> Result<Mat, ModelError> {
        Ok(Mat {
            m: DeviceMatrix::upload(gpu, &l.name, l.ty, l.rows, l.cols, l.bytes())
                .map_err(gpu_err)?,
            scale: l.scale(),
        })
    }

    pub(crate) fn from_parts(
        gpu: &Gpu,
        name: &str,
        ty: nextn_gguf::GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        scale: Option<f32>,
    ) -> Result<Mat, ModelError> {
        Ok(Mat {
            m: DeviceMatrix::upload(gpu, name, ty, rows, cols, bytes).map_err(gpu_err)?,
            scale,
        })
    }

    /// Output values a row.
    pub(crate) fn rows(&self) -> usize {
        self.m.rows()
    }

    /// The kernels this matrix's products run.
    pub(crate) fn kernels(&self, out: &mut Vec<&'static nextn_gpu::kernels::Kernel>) {
        out.extend(self.m.kernels());
    }

    /// The kernel that gathers its rows as an embedding table.
    pub(crate) fn embed_kernels(&self, out: &mut Vec<&'static nextn_gpu::kernels::Kernel>) {
        out.extend(self.m.embed_kernel());
    }

    pub(crate) fn device_bytes(&self) -> u64 {
        self.m.device_bytes()
    }

    /// `y[i][r] (+)= scale · W[r] · x[i]` for `n` rows of `x` (quantized rows in it are used as
    /// they are), `y` rows `y_stride` apart from `y_off`, added to what `y` holds with `add`.
    /// The kernel goes by `n` (one mat-vec workgroup for up to 8 rows, prefill tiles of 32 rows
    /// beyond), each row the same bits whichever runs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        x: &Acts,
        n: usize,
        y: &wgpu::Buffer,
        y_off: usize,
        y_stride: usize,
        add: bool,
    ) -> Result<(), ModelError> {
        let epilogue = Epilogue {
            add,
            scale: self.scale.unwrap_or(1.0),
        };
        product(rec, &self.m, x, u(n)?, y, u(y_off)?, u(y_stride)?, epilogue).map_err(gpu_err)
    }
}

/// The rows of a pass that need logits, from parts `(first row, rows, which need logits)`: their
/// indices among the pass's rows (for one gather and one LM-head product), and for each part where
/// its logit rows start among them and how many there are.
pub(crate) fn logit_rows(
    parts: impl Iterator<Item = (usize, usize, LogitRows)>,
) -> (Vec<u32>, Vec<(usize, usize)>) {
    let mut picked = Vec::new();
    let mut ranges = Vec::new();
    for (start, len, rows) in parts {
        let (first, count) = rows.span(len);
        ranges.push((picked.len(), count));
        picked.extend((start + first..start + first + count).map(|r| r as u32));
    }
    (picked, ranges)
}

/// The top-1 of the logits rows of the parts read back as [`Readback::Top1`], reduced on the
/// device in the pass that computed them.
pub(crate) struct Top1Rows {
    /// Per part: where its rows start in the reduced rows and how many, or none.
    parts: Vec<Option<(usize, usize)>>,
    /// Where the reduced rows come back.
    slot: Option<ReadSlot>,
}

impl Top1Rows {
    /// Record the reduction of the parts' rows, which `ranges` (as [`logit_rows`] gives them)
    /// place in `logits`, `width` floats a row, into `out` (grown as needed), and its read-back.
    pub(crate) fn record(
        rec: &mut Recorder,
        logits: &wgpu::Buffer,
        out: &mut Option<wgpu::Buffer>,
        width: usize,
        ranges: &[(usize, usize)],
        readbacks: &[Readback],
    ) -> Result<Top1Rows, ModelError> {
        let parts: Vec<Option<(usize, usize)>> = ranges
            .iter()
            .zip(readbacks)
            .map(|(&r, &rb)| (rb == Readback::Top1 && r.1 > 0).then_some(r))
            .collect();
        // One reduction over the span of every top-1 part's rows: the rows between them are
        // reduced too, a few microseconds, and none of them read back.
        let first = parts.iter().flatten().map(|r| r.0).min();
        let end = parts.iter().flatten().map(|r| r.0 + r.1).max();
        let (Some(first), Some(end)) = (first, end) else {
            return Ok(Top1Rows { parts, slot: None });
        };
        let buf = grow(rec.gpu(), out, "top1", (end - first) * 2)?;
        nextn_gpu::kernels::argmax::argmax_rows(
            rec,
            logits,
            u(first * width)?,
            u(width)?,
            u(width)?,
            u(end - first)?,
            &buf,
            0,
        )
        .map_err(gpu_err)?;
        let slot = rec.read_back(&buf, 0, ((end - first) * 8) as u64);
        let parts = parts
            .into_iter()
            .map(|p| p.map(|(s, c)| (s - first, c)))
            .collect();
        Ok(Top1Rows {
            parts,
            slot: Some(slot),
        })
    }

    /// Each part's top-1 rows (empty for a part read back whole), after the pass ran.
    pub(crate) fn read(self, back: &mut ReadBack) -> Vec<Vec<RowTop1>> {
        let words = self.slot.map(|s| back.u32s(s)).unwrap_or_default();
        self.parts
            .iter()
            .map(|p| {
                let Some((start, count)) = *p else {
                    return Vec::new();
                };
                (start..start + count)
                    .filter_map(|r| words.get(2 * r..2 * r + 2))
                    .map(|w| RowTop1 {
                        id: Some(w[0]).filter(|&i| i != nextn_gpu::kernels::argmax::NO_INDEX),
                        logit: f32::from_bits(w[1]),
                    })
                    .collect()
            })
            .collect()
    }
}

/// The read-backs of the logits rows of the parts read back whole (none for a top-1 part).
pub(crate) fn read_rows_back(
    rec: &mut Recorder,
    logits: &wgpu::Buffer,
    width: usize,
    ranges: &[(usize, usize)],
    readbacks: &[Readback],
) -> Vec<Option<ReadSlot>> {
    ranges
        .iter()
        .zip(readbacks)
        .map(|(&(start, count), &rb)| {
            (rb == Readback::Logits && count > 0).then(|| {
                rec.read_back(
                    logits,
                    (start * width * 4) as u64,
                    (count * width * 4) as u64,
                )
            })
        })
        .collect()
}

/// The rows [`read_rows_back`] asked for, per part (empty for a top-1 part); a trimmed LM
/// head's rows (`trimmed`) are scattered to the full vocabulary.
pub(crate) fn rows_read_back(
    back: &mut ReadBack,
    slots: Vec<Option<ReadSlot>>,
    ranges: &[(usize, usize)],
    trimmed: Option<&crate::draft_vocab::DraftLmHead>,
) -> Vec<Vec<f32>> {
    slots
        .into_iter()
        .zip(ranges)
        .map(|(slot, &(_, count))| {
            let Some(slot) = slot else {
                return Vec::new();
            };
            let rows = back.f32s(slot);
            match trimmed {
                Some(d) => d.scatter(&rows, count),
                None => rows,
            }
        })
        .collect()
}

/// The buffer in `slot`, grown (to the next power of two) when it holds fewer than `floats`
/// values: what a pass keeps from one pass to the next.
pub(crate) fn grow(
    gpu: &Gpu,
    slot: &mut Option<wgpu::Buffer>,
    label: &str,
    floats: usize,
) -> Result<wgpu::Buffer, ModelError> {
    let bytes = (floats.max(1) * 4) as u64;
    if let Some(b) = slot.as_ref().filter(|b| b.size() >= bytes) {
        return Ok(b.clone());
    }
    let b = gpu
        .buffer(label, bytes.next_power_of_two())
        .map_err(gpu_err)?;
    *slot = Some(b.clone());
    Ok(b)
}

/// The buffers of a pass's input and output, kept by the trunk (and the head) from pass to
/// pass.
#[derive(Default)]
pub(crate) struct PassIo {
    pub(crate) h: Option<wgpu::Buffer>,
    pub(crate) hidden: Option<wgpu::Buffer>,
    /// For each row of the pass, its row among those that need logits, or none.
    pub(crate) pick: Option<wgpu::Buffer>,
    /// The rows that need logits, f32 and quantized for the LM head (room for how many rows).
    pub(crate) rows: Option<wgpu::Buffer>,
    pub(crate) rows_q: Option<(layer::QuantRows, usize)>,
    pub(crate) logits: Option<wgpu::Buffer>,
    pub(crate) top1: Option<wgpu::Buffer>,
    /// The pass's token ids, for the embedding rows gathered on the device.
    pub(crate) ids: Option<wgpu::Buffer>,
    /// The head's input before its norms, after them, and quantized for its projection.
    pub(crate) raw: Option<wgpu::Buffer>,
    pub(crate) cat: Option<wgpu::Buffer>,
    pub(crate) cat_q: Option<(layer::QuantRows, usize)>,
}

/// Quantized rows in `slot` with room for `rows` rows of `width`, made anew when too small.
pub(crate) fn grow_quant<'a>(
    gpu: &Gpu,
    slot: &'a mut Option<(layer::QuantRows, usize)>,
    label: &str,
    rows: usize,
    width: usize,
) -> Result<&'a layer::QuantRows, ModelError> {
    if slot.as_ref().is_none_or(|(_, have)| *have < rows) {
        let rows = rows.next_power_of_two();
        *slot = Some((layer::QuantRows::new(gpu, label, rows, width)?, rows));
    }
    slot.as_ref()
        .map(|(q, _)| q)
        .ok_or_else(|| ModelError::Device("no quantized rows".into()))
}

/// Where each part's logits rows sit among a pass's picked rows: (first, count).
pub(crate) type PartRows = Vec<(usize, usize)>;

/// What the end of a pass reads back, recorded by [`record_tail`].
pub(crate) struct TailSlots {
    pub(crate) hidden: ReadSlot,
    pub(crate) rows: Vec<Option<ReadSlot>>,
    pub(crate) top1: Top1Rows,
    pub(crate) ranges: Vec<(usize, usize)>,
}

/// Where the end of a pass leaves its results: read back (`ReadBack`, each part as its
/// [`Readback`] says), or, for a head pass whose rows with logits are all greedy drafts, their
/// top-1 pairs into the drafted tokens on the device from pair `at` (`Drafts`) and nothing read.
pub(crate) enum TailOut<'a> {
    ReadBack(&'a [Readback]),
    Drafts { buf: &'a wgpu::Buffer, at: u32 },
}

/// The end of a pass over `n` rows of `h` (`e` wide): the final norm of every row into
/// `io.hidden` (the head's seed), in the same dispatch the rows that need logits picked and
/// quantized for the LM head, one LM-head product over them, and their results as `out` says.
/// `parts`: each part's first row, rows and which need logits. Returns the read-backs (none with
/// `TailOut::Drafts`) and where each part's logits rows sit among the picked rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record_tail(
    rec: &mut Recorder,
    io: &mut PassIo,
    h: &wgpu::Buffer,
    n: usize,
    e: usize,
    norm_w: &wgpu::Buffer,
    eps: f32,
    lm: &Mat,
    parts: impl Iterator<Item = (usize, usize, LogitRows)>,
    out: TailOut,
) -> Result<(Option<TailSlots>, PartRows), ModelError> {
    let gpu = rec.gpu();
    let (picked, ranges) = logit_rows(parts);
    let n_picked = picked.len();
    let width = lm.rows();
    let hidden = grow(gpu, &mut io.hidden, "hidden", n * e)?;
    let pick = grow(gpu, &mut io.pick, "pick", n)?;
    let mut map = vec![u32::MAX; n];
    for (i, &r) in picked.iter().enumerate() {
        map[r as usize] = i as u32;
    }
    rec.upload(&pick, 0, bytemuck::cast_slice(&map));
    let rows = grow(gpu, &mut io.rows, "picked-rows", n_picked.max(1) * e)?;
    let needs = layer::Needs::of(&lm.m);
    let rows_q = grow_quant(gpu, &mut io.rows_q, "picked-rows", n_picked.max(1), e)?;
    let eu = u(e)?;
    let norm_out = NormOut {
        y: Some((&hidden, 0, eu)),
        q8_0: needs.q8_0.then_some(&rows_q.q8_0),
        q8k: needs.q8k.then_some(&rows_q.q8k),
        pick: Some((&pick, 0)),
        picked: Some((&rows, 0, eu)),
    };
    norm_quant(
        rec,
        h,
        0,
        eu,
        eu,
        u(n)?,
        1,
        eu,
        norm_w,
        0,
        0,
        &norm_out,
        eps,
    )
    .map_err(gpu_err)?;
    let logits = grow(gpu, &mut io.logits, "logits", n_picked.max(1) * width)?;
    if n_picked > 0 {
        let acts = rows_q.acts(&rows, eu, needs);
        lm.forward(rec, &acts, n_picked, &logits, 0, width, false)?;
    }
    match out {
        TailOut::Drafts { buf, at } => {
            if n_picked > 0 {
                nextn_gpu::kernels::argmax::argmax_rows(
                    rec,
                    &logits,
                    0,
                    u(width)?,
                    u(width)?,
                    u(n_picked)?,
                    buf,
                    2 * at,
                )
                .map_err(gpu_err)?;
            }
            Ok((None, ranges))
        }
        TailOut::ReadBack(readbacks) => {
            let top1 = Top1Rows::record(rec, &logits, &mut io.top1, width, &ranges, readbacks)?;
            let hidden_slot = rec.read_back(&hidden, 0, (n * e * 4) as u64);
            let row_slots = read_rows_back(rec, &logits, width, &ranges, readbacks);
            Ok((
                Some(TailSlots {
                    hidden: hidden_slot,
                    rows: row_slots,
                    top1,
                    ranges: ranges.clone(),
                }),
                ranges,
            ))
        }
    }
}

/// The tokens head passes drafted and left on the device: (id, logit bits) pairs as the argmax
/// writes them, `next` of them in use until the target pass that takes them reads them back.
pub(crate) struct Drafted {
    pub(crate) buf: wgpu::Buffer,
    pub(crate) next: u32,
}

/// Bytes a pass reads back: `hidden` floats, the whole logits rows (`width` floats each, the
/// device's width) of the parts read back whole, and 8 bytes per row of the top-1 parts.
pub(crate) fn read_bytes(
    hidden: usize,
    ranges: &[(usize, usize)],
    readbacks: &[Readback],
    width: usize,
) -> usize {
    let per_row = |rb: Readback| match rb {
        Readback::Logits => 4 * width,
        Readback::Top1 => 8,
    };
    4 * hidden
        + ranges
            .iter()
            .zip(readbacks)
            .map(|(&(_, count), &rb)| count * per_row(rb))
            .sum::<usize>()
}

/// A size as the kernels' u32 parameter.
pub(crate) fn u(v: usize) -> Result<u32, ModelError> {
    u32::try_from(v).map_err(|_| ModelError::Device(format!("{v} is too large for a kernel")))
}

/// An f32 vector (norm weights, biases) on the device.
pub(crate) fn vector(gpu: &Gpu, name: &str, v: &[f32]) -> Result<wgpu::Buffer, ModelError> {
    gpu.upload(name, bytemuck::cast_slice(v)).map_err(gpu_err)
}

/// A zeroed f32 scratch buffer of `n` values.
pub(crate) fn scratch(gpu: &Gpu, label: &str, n: usize) -> Result<wgpu::Buffer, ModelError> {
    gpu.buffer(label, (n.max(1) * 4) as u64).map_err(gpu_err)
}

/// What the device did since the counters were last reset: forward passes (trunk and head), what
/// the runtime created and did for them (dispatches, submissions, blocking read-backs, and any
/// buffers, bind groups or pipelines it had to make), the bytes read back and, when timing is
/// on, the device time the timed passes took by timestamp queries.
#[derive(Clone, Debug, Default)]
pub struct DeviceStats {
    /// Forward passes, trunk and head.
    pub passes: u64,
    /// The trunk's forward passes: one per step of the generation loop.
    pub target_passes: u64,
    /// Submissions inside a pass where it hands rows to the CPU (a layer's routed experts in
    /// host memory); not passes of their own.
    pub crossings: u64,
    /// The runtime's counters over the same span (commits and reads of caches included).
    pub runtime: nextn_gpu::Counters,
    /// Bytes the forward passes read back: hidden rows, logits rows and top-1 rows.
    pub read_back_bytes: u64,
    /// Submissions timed by timestamp queries (one a step: the passes of a step go in one).
    pub timed_submissions: u64,
    pub gpu_seconds: f64,
    /// With profiling on: device time by kernel over the passes whose dispatches were timed.
    pub kernels: std::collections::BTreeMap<&'static str, KernelTime>,
    /// The device time of the passes whose dispatches were timed (the kernels' times add up to it).
    pub profiled_seconds: f64,
}

/// Where the device's counters stand at one moment ([`DeviceModel::progress`]): the difference
/// of two is what happened between them.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceProgress {
    pub passes: u64,
    pub target_passes: u64,
    pub runtime: nextn_gpu::Counters,
}

impl DeviceProgress {
    pub fn since(&self, before: &DeviceProgress) -> DeviceProgress {
        DeviceProgress {
            passes: self.passes.saturating_sub(before.passes),
            target_passes: self.target_passes.saturating_sub(before.target_passes),
            runtime: self.runtime.since(&before.runtime),
        }
    }

    pub fn add(&mut self, other: &DeviceProgress) {
        let (a, b) = (&mut self.runtime, &other.runtime);
        self.passes += other.passes;
        self.target_passes += other.target_passes;
        a.buffers_created += b.buffers_created;
        a.bind_groups_created += b.bind_groups_created;
        a.pipelines_created += b.pipelines_created;
        a.dispatches += b.dispatches;
        a.submissions += b.submissions;
        a.read_backs += b.read_backs;
    }
}

/// One kernel's share of the profiled passes.
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelTime {
    pub dispatches: u64,
    pub seconds: f64,
    /// The fewest bytes its dispatches move through device memory, together.
    pub bytes: u64,
    /// The workgroups its dispatches launched, together.
    pub workgroups: u64,
    /// The fewest workgroups one of its dispatches launched.
    pub fewest_workgroups: u64,
}

/// The counters a model and its head share; timing needs the pass's read-back, so it is on only
/// when asked for (`nextn bench`).
#[derive(Default)]
pub(crate) struct Counters {
    stats: std::sync::Mutex<DeviceStats>,
    /// The runtime's counters when the stats were last taken.
    since: std::sync::Mutex<nextn_gpu::Counters>,
    timing: std::sync::atomic::AtomicBool,
    profiling: std::sync::atomic::AtomicBool,
}

impl Counters {
    /// Count `bytes` read back from the device.
    pub(crate) fn read_back(&self, bytes: usize) {
        if let Ok(mut s) = self.stats.lock() {
            s.read_back_bytes += bytes as u64;
        }
    }

    /// Count the forward pass in `rec` and leave it to run with the next submission.
    pub(crate) fn defer(&self, rec: Recorder) -> Result<(), ModelError> {
        rec.defer().map_err(gpu_err)?;
        if let Ok(mut s) = self.stats.lock() {
            s.passes += 1;
        }
        Ok(())
    }

    /// Submit the forward pass in `rec` (after any deferred work) and wait for what it reads
    /// back, counting it (`target`: a trunk pass) and timing it when timing is on.
    pub(crate) fn submit_read(&self, rec: Recorder, target: bool) -> Result<ReadBack, ModelError> {
        self.submit(rec, Some(target))
    }

    /// Submit what a pass recorded so far (after any deferred work) and wait for what it reads
    /// back, counted as a crossing to the CPU inside the pass.
    pub(crate) fn submit_crossing(&self, rec: Recorder) -> Result<ReadBack, ModelError> {
        self.submit(rec, None)
    }

    /// `pass`: a forward pass (`Some(target)`) or a crossing inside one (`None`).
    fn submit(&self, rec: Recorder, pass: Option<bool>) -> Result<ReadBack, ModelError> {
        let order = std::sync::atomic::Ordering::Relaxed;
        let timing = if self.profiling.load(order) {
            nextn_gpu::Timing::Dispatches
        } else if self.timing.load(order) {
            nextn_gpu::Timing::Pass
        } else {
            nextn_gpu::Timing::Off
        };
        let back = rec.submit_read(timing).map_err(gpu_err)?;
        if let Ok(mut s) = self.stats.lock() {
            match pass {
                Some(target) => {
                    s.passes += 1;
                    s.target_passes += u64::from(target);
                }
                None => s.crossings += 1,
            }
            if let Some(t) = &back.time {
                s.timed_submissions += 1;
                s.gpu_seconds += t.seconds;
                if !t.dispatches.is_empty() {
                    s.profiled_seconds += t.seconds;
                }
                for d in &t.dispatches {
                    let k = s.kernels.entry(d.kernel).or_default();
                    if k.dispatches == 0 || d.workgroups < k.fewest_workgroups {
                        k.fewest_workgroups = d.workgroups;
                    }
                    k.dispatches += 1;
                    k.seconds += d.seconds;
                    k.bytes += d.bytes;
                    k.workgroups += d.workgroups;
                }
            }
        }
        Ok(back)
    }

    /// Where the counters stand, without starting them anew.
    pub(crate) fn progress(&self, gpu: &Gpu) -> DeviceProgress {
        let (passes, target_passes) = self
            .stats
            .lock()
            .map(|s| (s.passes, s.target_passes))
            .unwrap_or_default();
        DeviceProgress {
            passes,
            target_passes,
            runtime: gpu.counters(),
        }
    }

    /// The stats since the last call, which starts them anew.
    pub(crate) fn take(&self, gpu: &Gpu) -> DeviceStats {
        let now = gpu.counters();
        let mut s = self
            .stats
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default();
        if let Ok(mut since) = self.since.lock() {
            s.runtime = now.since(&since);
            *since = now;
        }
        s
    }
}

/// The trunk on the device: its layers from `placement.first_device_layer` on, the final norm and
/// the LM head.
pub struct DeviceModel {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) counters: Arc<Counters>,
    placement: Placement,
    /// Trunk layers `placement.first_device_layer..`.
    pub(crate) layers: Vec<DeviceLayer>,
    output_norm: wgpu::Buffer,
    lm_head: Arc<Mat>,
    bytes: u64,
    /// The activations every pass shares with the head's passes.
    pub(crate) pass: Arc<Mutex<layer::PassBuffers>>,
    io: Mutex<PassIo>,
    /// The token embedding table on the device, when it is there: the LM head of a tied model,
    /// or uploaded when a head drafts on the device ([`DeviceModel::embeddings`]). With it the
    /// passes gather their rows on the device, drafted tokens included.
    embed: Mutex<Option<Arc<Mat>>>,
    /// Tokens the head drafted and left on the device, shared with the head.
    pub(crate) drafted: Arc<Mutex<Drafted>>,
    /// The name of the embedding tensor (for the head, whose table may be the same one).
    embed_name: String,
    /// The largest sequence [`Model::check_sequence`] made room for: its context, cache types
    /// and device bytes, which the embedding table leaves free.
    checked: Mutex<Option<CheckedSequence>>,
}

/// A sequence the device was checked to hold ([`Model::check_sequence`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CheckedSequence {
    pub(crate) n_ctx: usize,
    pub(crate) k_type: KvType,
    pub(crate) v_type: KvType,
    /// Device bytes of its trunk caches.
    pub(crate) bytes: u64,
}

/// A lock that a panic elsewhere poisoned is a device error, not a panic here.
pub(crate) fn locked<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>, ModelError> {
    m.lock()
        .map_err(|_| ModelError::Device("a device lock was poisoned".into()))
}

impl DeviceModel {
    /// Upload every trunk weight of `model` and build every pipeline its passes use. An untied
    /// embedding table stays in host memory until a head that drafts on the device needs it.
    pub fn upload(
        model: &Model,
        gpu: Arc<Gpu>,
        placement: Placement,
    ) -> Result<DeviceModel, ModelError> {
        let cfg = &model.config;
        let first = placement.first_device_layer.min(model.layers.len());
        let mut bytes = 0;
        let mut layers = Vec::with_capacity(model.layers.len() - first);
        for (j, l) in model.layers[first..].iter().enumerate() {
            let d = DeviceLayer::upload(&gpu, l, cfg, placement.experts_on_host(first + j))?;
            bytes += d.device_bytes();
            layers.push(d);
        }
        let lm_head = Arc::new(Mat::upload(&gpu, &model.lm_head)?);
        bytes += lm_head.device_bytes();
        let output_norm = vector(&gpu, "output_norm", &model.output_norm)?;
        gpu.check().map_err(gpu_err)?;
        let mut kernels = Vec::new();
        for l in &layers {
            l.kernels(&mut kernels);
        }
        lm_head.kernels(&mut kernels);
        lm_head.embed_kernels(&mut kernels);
        kernels.extend(fixed_kernels());
        gpu.prepare(&kernels).map_err(gpu_err)?;
        let pass = layer::PassBuffers::new(&gpu, layer::PassWidths::of(cfg), 1)?;
        // A tied LM head is the embedding table: its rows are gathered on the device for free,
        // when the first layer is there to take them.
        let tied = model.lm_head.name == model.token_embd.name && first == 0;
        let drafted = gpu
            .buffer("drafted tokens", (DEVICE_TOKENS as u64) * 8)
            .map_err(gpu_err)?;
        Ok(DeviceModel {
            placement: Placement {
                first_device_layer: first,
                ..placement
            },
            embed: Mutex::new(tied.then(|| lm_head.clone())),
            embed_name: model.token_embd.name.clone(),
            checked: Mutex::new(None),
            gpu,
            counters: Arc::new(Counters::default()),
            layers,
            output_norm,
            lm_head,
            bytes,
            pass: Arc::new(Mutex::new(pass)),
            io: Mutex::new(PassIo::default()),
            drafted: Arc::new(Mutex::new(Drafted {
                buf: drafted,
                next: 0,
            })),
        })
    }

    /// Note that the device holds a sequence of `bytes` of trunk caches (the largest kept).
    pub(crate) fn note_sequence(&self, seq: CheckedSequence) -> Result<(), ModelError> {
        let mut checked = locked(&self.checked)?;
        if checked.is_none_or(|c| c.bytes < seq.bytes) {
            *checked = Some(seq);
        }
        Ok(())
    }

    /// The largest sequence the device was checked to hold.
    pub(crate) fn checked_sequence(&self) -> Result<Option<CheckedSequence>, ModelError> {
        Ok(*locked(&self.checked)?)
    }

    /// The embedding table `table` on the device: the model's own (made resident on first need
    /// and kept) when `table` is the model's token embedding, else an upload of its own. Returns
    /// the matrix and the device bytes this call added, or `None` when the device's memory
    /// cannot hold it and still leave `keep_free` bytes (a sequence's caches): the rows are then
    /// gathered on the host.
    pub(crate) fn embeddings(
        &self,
        table: &Linear,
        keep_free: u64,
    ) -> Result<Option<(Arc<Mat>, u64)>, ModelError> {
        let fits = || match self.gpu.memory_budget() {
            (Some(limit), used) => {
                used.saturating_add(table.bytes().len() as u64)
                    .saturating_add(keep_free)
                    <= limit
            }
            (None, _) => true,
        };
        let upload = || match fits().then(|| Mat::upload(&self.gpu, table)) {
            None => Ok(None),
            Some(Ok(m)) => Ok(Some(Arc::new(m))),
            Some(Err(ModelError::DeviceMemory(_))) => Ok(None),
            Some(Err(e)) => Err(e),
        };
        if table.name != self.embed_name {
            return Ok(upload()?.map(|m| {
                let bytes = m.device_bytes();
                (m, bytes)
            }));
        }
        let mut embed = locked(&self.embed)?;
        if let Some(m) = embed.as_ref() {
            return Ok(Some((m.clone(), 0)));
        }
        let Some(m) = upload()? else {
            return Ok(None);
        };
        let bytes = m.device_bytes();
        let mut kernels = Vec::new();
        m.embed_kernels(&mut kernels);
        self.gpu.prepare(&kernels).map_err(gpu_err)?;
        *embed = Some(m.clone());
        Ok(Some((m, bytes)))
    }

    /// Whether the trunk's passes gather their embedding rows on the device (and so can take
    /// drafted tokens that stayed there).
    pub(crate) fn gathers_embeddings(&self) -> Result<bool, ModelError> {
        Ok(self.placement.first_device_layer == 0 && locked(&self.embed)?.is_some())
    }

    /// Which parts run here.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Device memory the weights take.
    pub fn weight_bytes(&self) -> u64 {
        self.bytes
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Time every pass on the device from now on (when it has timestamp queries).
    pub fn set_timing(&self, on: bool) {
        self.counters
            .timing
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Time each dispatch of every pass from now on, by kernel (where the device can write
    /// timestamps inside a pass); implies [`Self::set_timing`]'s pass times.
    pub fn set_profiling(&self, on: bool) {
        self.counters
            .profiling
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Where the counters stand now (they go on counting).
    pub fn progress(&self) -> DeviceProgress {
        self.counters.progress(&self.gpu)
    }

    /// The counters since the last call, which starts them anew.
    pub fn take_stats(&self) -> DeviceStats {
        self.counters.take(&self.gpu)
    }

    pub(crate) fn lm_head(&self) -> Arc<Mat> {
        self.lm_head.clone()
    }

    /// Fresh device caches for one sequence of at most `n_ctx` positions.
    pub(crate) fn new_caches(
        &self,
        model: &Model,
        n_ctx: usize,
        k_type: KvType,
        v_type: KvType,
    ) -> Result<Vec<LayerCache>, ModelError> {
        let first = self.placement.first_device_layer;
        self.layers
            .iter()
            .enumerate()
            .map(|(j, l)| l.new_cache(&self.gpu, &model.config, first + j, n_ctx, k_type, v_type))
            .collect()
    }

    /// [`Model::forward_batch`] on the device: one submission (after whatever was deferred
    /// before it) and one wait for what it reads back. `host_rows`: the hidden rows after the
    /// layers that ran on the CPU, when some did (uploaded in place of the embeddings).
    pub(crate) fn forward_batch(
        &self,
        model: &Model,
        items: &mut [BatchItem],
        host_rows: Option<&[f32]>,
        pool: &ThreadPool,
    ) -> Result<Vec<ForwardOutput>, ModelError> {
        self.run_pass(model, items, host_rows, None, pool)
    }

    /// [`Model::forward_image`] on the device: the rows of one image `nx` tokens wide, `rows`
    /// its embeddings (or its hidden rows after the layers that ran on the CPU), through the
    /// device's layers at the image's positions after `item`'s committed rows (`item.tokens`
    /// empty). Commits them as a pass of text rows would; the caller notes the image's span.
    pub(crate) fn forward_image(
        &self,
        model: &Model,
        item: BatchItem,
        rows: &[f32],
        nx: usize,
        pool: &ThreadPool,
    ) -> Result<ForwardOutput, ModelError> {
        let mut items = [item];
        let mut outs = self.run_pass(model, &mut items, Some(rows), Some(nx), pool)?;
        outs.pop()
            .ok_or_else(|| ModelError::Device("an image pass gave no output".into()))
    }

    /// One pass over `items`' rows: their tokens, or the host's `host_rows` (the rows of one
    /// image `image_nx` wide, when given, at the image's positions).
    fn run_pass(
        &self,
        model: &Model,
        items: &mut [BatchItem],
        host_rows: Option<&[f32]>,
        image_nx: Option<usize>,
        pool: &ThreadPool,
    ) -> Result<Vec<ForwardOutput>, ModelError> {
        let gpu = &*self.gpu;
        let cfg = &model.config;
        let e = cfg.n_embd;
        let mut tokens = Vec::new();
        let mut starts = Vec::with_capacity(items.len());
        let mut lens = Vec::with_capacity(items.len());
        for it in items.iter() {
            starts.push(tokens.len());
            lens.push(it.tokens.len());
            tokens.extend_from_slice(it.tokens);
        }
        let image = match (image_nx, host_rows) {
            (Some(nx), Some(rows)) if items.len() == 1 && tokens.is_empty() => {
                lens[0] = rows.len() / e.max(1);
                Some(nx)
            }
            (None, _) => None,
            _ => {
                return Err(ModelError::Device(
                    "an image pass takes its rows from the host, for one sequence".into(),
                ))
            }
        };
        let n: usize = lens.iter().sum();
        let n_vocab = model.n_vocab;
        if n == 0 {
            return Ok(items
                .iter()
                .map(|_| ForwardOutput::empty(n_vocab))
                .collect());
        }
        let drafted_rows = tokens.iter().any(|&t| is_device_token(t));
        if let Some(&t) = tokens
            .iter()
            .find(|&&t| !is_device_token(t) && t as usize >= n_vocab)
        {
            return Err(ModelError::TokenOutOfRange {
                token: t as u64,
                n_vocab,
            });
        }
        let table = locked(&self.embed)?.clone();
        let mut io = locked(&self.io)?;
        let mut pass = locked(&self.pass)?;
        let mut drafted = locked(&self.drafted)?;
        pass.reserve(n)?;
        let h = grow(gpu, &mut io.h, "h", n * e)?;
        let mut rec = Recorder::new(gpu);
        match (host_rows, &table) {
            (Some(_), _) if drafted_rows => {
                return Err(ModelError::Device(
                    "drafted tokens on the device, and the first layers on the CPU".into(),
                ))
            }
            (Some(rows), _) if rows.len() != n * e => {
                return Err(ModelError::HiddenLength {
                    found: rows.len(),
                    rows: n,
                    width: e,
                })
            }
            // The rows after the layers that ran on the CPU (or an image's embeddings).
            (Some(rows), _) => rec.upload(&h, 0, bytemuck::cast_slice(rows)),
            // The rows gathered on the device, drafted tokens among them.
            (None, Some(table)) => {
                let ids = grow(gpu, &mut io.ids, "token ids", n)?;
                rec.upload(&ids, 0, bytemuck::cast_slice(&tokens));
                embed_rows(
                    &mut rec,
                    &table.m,
                    &ids,
                    0,
                    &drafted.buf,
                    u(n)?,
                    &h,
                    0,
                    u(e)?,
                )
                .map_err(gpu_err)?;
            }
            (None, None) if drafted_rows => {
                return Err(ModelError::Device(
                    "drafted tokens on the device, and no embedding table there".into(),
                ))
            }
            (None, None) => rec.upload(&h, 0, bytemuck::cast_slice(&model.embed(&tokens)?)),
        }
        let first = self.placement.first_device_layer;
        for (j, layer) in self.layers.iter().enumerate() {
            let mut segments = Vec::new();
            for ((it, &s), &len) in items.iter_mut().zip(&starts).zip(&lens) {
                if len == 0 {
                    continue;
                }
                let shift = it.state.rope_shift();
                let positions = match image {
                    Some(nx) => RowPositions::Image {
                        p0: it.state.n_past - shift,
                        nx,
                    },
                    None => RowPositions::Text { shift },
                };
                segments.push(Segment {
                    rows: s..s + len,
                    start_pos: it.state.n_past,
                    cache: &mut it.state.layers[first + j],
                    verify: it.verify,
                    positions,
                });
            }
            // A layer whose routed experts are in host memory computes them there.
            let host = match &model.layers[first + j].ffn {
                Ffn::Moe(ffn) if self.placement.experts_on_host(first + j) => Some(HostExperts {
                    ffn,
                    pool,
                    counters: &self.counters,
                }),
                _ => None,
            };
            layer.forward(&mut rec, &h, n, &mut segments, &mut pass, host)?;
        }
        drop(pass);
        let readbacks: Vec<Readback> = items.iter().map(|it| it.readback).collect();
        let (tail, _) = record_tail(
            &mut rec,
            &mut io,
            &h,
            n,
            e,
            &self.output_norm,
            cfg.rms_eps,
            &self.lm_head,
            items
                .iter()
                .zip(starts.iter().zip(&lens))
                .map(|(it, (&s, &len))| (s, len, it.logits)),
            TailOut::ReadBack(&readbacks),
        )?;
        let tail = tail.ok_or_else(|| ModelError::Device("no read-back recorded".into()))?;
        // What the drafted tokens these rows took were.
        let drafts_slot = (drafted_rows && drafted.next > 0)
            .then(|| rec.read_back(&drafted.buf, 0, drafted.next as u64 * 8));
        let mut back = self.counters.submit_read(rec, true)?;
        // The drafts are read: the next step's head passes may draft anew.
        drafted.next = 0;
        drop(drafted);
        let pairs = drafts_slot.map(|s| back.u32s(s)).unwrap_or_default();
        let hidden_host = back.f32s(tail.hidden);
        let rows_back = rows_read_back(&mut back, tail.rows, &tail.ranges, None);
        let top1 = tail.top1.read(&mut back);
        self.counters
            .read_back(read_bytes(n * e, &tail.ranges, &readbacks, n_vocab) + pairs.len() * 4);
        let resolve = |t: u32| -> Option<u32> {
            if !is_device_token(t) {
                return Some(t);
            }
            let k = (t - DEVICE_TOKEN) as usize;
            let (id, logit) = (*pairs.get(2 * k)?, f32::from_bits(*pairs.get(2 * k + 1)?));
            ((id as usize) < n_vocab && logit > f32::NEG_INFINITY).then_some(id)
        };
        let mut outs = Vec::with_capacity(items.len());
        let back = rows_back.into_iter().zip(top1);
        for ((it, (&s, &len)), (logits, top1)) in
            items.iter_mut().zip(starts.iter().zip(&lens)).zip(back)
        {
            it.state.n_past += len;
            if it.verify {
                it.state.pending_rows = len;
            }
            let tokens = if it.tokens.iter().any(|&t| is_device_token(t)) {
                it.tokens.iter().map(|&t| resolve(t)).collect()
            } else {
                Vec::new()
            };
            outs.push(ForwardOutput {
                hidden: hidden_host[s * e..(s + len) * e].to_vec(),
                device_hidden: None,
                tokens,
                logits,
                n_vocab,
                top1,
            });
        }
        Ok(outs)
    }

    /// [`Model::commit`] on the device: keep `keep` of the pending rows. What it has to run on
    /// the device (a replay of kept rows) is deferred to the next submission.
    /// `caches` are the sequence's caches of this device's layers, `pending` its verify rows.
    pub(crate) fn commit(
        &self,
        caches: &mut [LayerCache],
        keep: usize,
        pending: usize,
    ) -> Result<(), ModelError> {
        let mut rec = Recorder::new(&self.gpu);
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            layer.commit(&mut rec, cache, keep, pending)?;
        }
        rec.defer().map_err(gpu_err)
    }
}

/// The kernels every model runs whatever its weights (norms, attention, the delta net, the
/// small ones between products).
pub(crate) fn fixed_kernels() -> Vec<&'static nextn_gpu::kernels::Kernel> {
    use nextn_gpu::kernels as k;
    let mut v: Vec<&'static k::Kernel> = Vec::new();
    v.extend(k::elementwise::KERNELS);
    v.extend(k::norm::KERNELS);
    v.extend(k::argmax::KERNELS);
    v.extend(k::delta_net::KERNELS);
    v.extend(k::attention::KERNELS);
    v.push(&k::matvec::QUANTIZE_Q8);
    v
}

/// What `-dev` / `-ngl` choose: a device to open, or the CPU. `NEXTN_GPU_INT8=0` keeps the
/// quantized products on f32 activations where the adapter has int8 dot products (for
/// comparisons; the load line says which path runs). `NEXTN_GPU_MEMORY_MIB` caps the device
/// memory weights and caches may take (the device's own memory otherwise).
/// `NEXTN_GPU_ROW_THREADS` sets [`Gpu::row_threads`] (to run a GPU's setting on lavapipe);
/// `NEXTN_GPU_SUBGROUPS=0` keeps the products' reductions in workgroup memory (the same bits).
pub fn open_device(name: Option<&str>) -> Result<Arc<Gpu>, ModelError> {
    let memory_budget = match std::env::var("NEXTN_GPU_MEMORY_MIB") {
        Err(_) => None,
        Ok(v) => Some(
            v.trim()
                .parse::<u64>()
                .ok()
                .filter(|&m| m > 0)
                .and_then(|m| m.checked_mul(1 << 20))
                .ok_or_else(|| {
                    ModelError::Device(format!(
                        "NEXTN_GPU_MEMORY_MIB={v:?} is not a positive whole number of MiB"
                    ))
                })?,
        ),
    };
    let mut gpu = Gpu::open(&nextn_gpu::OpenOptions {
        name: name.map(str::to_string),
        validation: std::env::var("NEXTN_GPU_VALIDATION").as_deref() == Ok("1"),
        memory_budget,
        pipeline_cache_dir: pipeline_cache_dir(),
    })
    .map_err(gpu_err)?;
    if std::env::var("NEXTN_GPU_INT8").as_deref() == Ok("0") {
        gpu.disable_int8_dot();
    }
    if std::env::var("NEXTN_GPU_SUBGROUPS").as_deref() == Ok("0") {
        gpu.disable_subgroups();
    }
    if let Ok(v) = std::env::var("NEXTN_GPU_ROW_THREADS") {
        let threads = v.trim().parse::<u32>().map_err(|_| {
            ModelError::Device(format!(
                "NEXTN_GPU_ROW_THREADS={v:?} is not a whole number of threads"
            ))
        })?;
        gpu.set_row_threads(threads)
            .map_err(|e| ModelError::Device(format!("NEXTN_GPU_ROW_THREADS={v:?}: {e}")))?;
    }
    Ok(Arc::new(gpu))
}

/// Where compiled pipelines are kept between runs: `NEXTN_PIPELINE_CACHE` (a directory; `0` or
/// empty turns the cache off), else `$XDG_CACHE_HOME/nextn/pipelines`, else
/// `~/.cache/nextn/pipelines`.
fn pipeline_cache_dir() -> Option<std::path::PathBuf> {
    match std::env::var_os("NEXTN_PIPELINE_CACHE") {
        Some(v) if v.is_empty() || v == "0" => return None,
        Some(v) => return Some(v.into()),
        None => {}
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?;
    Some(base.join("nextn").join("pipelines"))
}
