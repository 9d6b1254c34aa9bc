//! The forward pass on a GPU (`-dev`, `-ngl`): the same trunk, NextN head, verify and commit as
//! the CPU path, over `nextn-gpu`'s kernels, with every weight and every cache on the device.
//!
//! `Model::offload` uploads the trunk; from then on `Model::forward_batch`, `Model::commit` and
//! `Model::new_sequence` run here, and `NextnHead::load` uploads the head beside it. The engine
//! does not know which path runs. One pass is one submission: the token embeddings go up (the
//! embedding table stays in host memory, as llama.cpp keeps it), and what comes back is what the
//! sampler and the head need: the logits of the rows asked for, and every row's post-norm hidden
//! state (`n × n_embd` floats) that seeds the head.

mod cache;
mod layer;
mod nextn;

use std::sync::Arc;

use nextn_gpu::kernels::elementwise::gather_rows;
use nextn_gpu::kernels::matvec::matvec;
use nextn_gpu::kernels::norm::rms_norm;
use nextn_gpu::weights::DeviceMatrix;
use nextn_gpu::{Gpu, GpuError, Recorder};

pub use cache::{DeviceDeltaNetCache, DeviceKvCache};
pub(crate) use layer::DeviceLayer;
pub(crate) use nextn::DeviceHead;

use crate::batch::{BatchItem, ForwardOutput, LogitRows, Readback, RowTop1, Segment};
use crate::cache::{KvType, LayerCache, SequenceState};
use crate::model::Model;
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
    scale: Option<f32>,
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

    pub(crate) fn rows(&self) -> usize {
        self.m.rows()
    }

    pub(crate) fn device_bytes(&self) -> u64 {
        self.m.device_bytes()
    }

    /// `y[i][r] = scale · W[r] · x[i]` for `n` rows; `x` rows `cols` apart from `x_off`, `y` rows
    /// `y_stride` apart from `y_off`. The kernel goes by `n` (`matvec`: one mat-vec workgroup
    /// for up to 8 rows, prefill tiles of 32 rows beyond), each row the same bits whichever runs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        x: &wgpu::Buffer,
        x_off: usize,
        x_stride: usize,
        n: usize,
        y: &wgpu::Buffer,
        y_off: usize,
        y_stride: usize,
    ) -> Result<(), ModelError> {
        matvec(
            rec,
            &self.m,
            x,
            u(x_off)?,
            u(x_stride)?,
            u(n)?,
            y,
            u(y_off)?,
            u(y_stride)?,
        )
        .map_err(gpu_err)?;
        if let Some(s) = self.scale {
            let rows = self.m.rows();
            if y_stride == rows {
                // Contiguous output rows: one dispatch over all of them.
                return nextn_gpu::kernels::elementwise::scale(rec, y, u(y_off)?, u(n * rows)?, s)
                    .map_err(gpu_err);
            }
            for i in 0..n {
                nextn_gpu::kernels::elementwise::scale(
                    rec,
                    y,
                    u(y_off + i * y_stride)?,
                    u(self.m.rows())?,
                    s,
                )
                .map_err(gpu_err)?;
            }
        }
        Ok(())
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
    /// Per part: where its rows start in `buf` (in rows) and how many, or none.
    parts: Vec<Option<(usize, usize)>>,
    buf: Option<wgpu::Buffer>,
}

impl Top1Rows {
    /// Record the reduction of the parts' rows, which `ranges` (as [`logit_rows`] gives them)
    /// place in `logits`, `width` floats a row.
    pub(crate) fn record(
        rec: &mut Recorder,
        logits: &wgpu::Buffer,
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
            return Ok(Top1Rows { parts, buf: None });
        };
        let buf = rec
            .gpu()
            .buffer("top1", ((end - first) * 8) as u64)
            .map_err(gpu_err)?;
        nextn_gpu::kernels::argmax::argmax_rows(
            rec,
            logits,
            u(first * width)?,
            u(width)?,
            u(width)?,
            u(end - first)?,
            &buf,
        )
        .map_err(gpu_err)?;
        let parts = parts
            .into_iter()
            .map(|p| p.map(|(s, c)| (s - first, c)))
            .collect();
        Ok(Top1Rows {
            parts,
            buf: Some(buf),
        })
    }

    /// Each part's top-1 rows (empty for a part read back whole), after the pass ran.
    pub(crate) fn read(self, gpu: &Gpu) -> Result<Vec<Vec<RowTop1>>, ModelError> {
        let words = match &self.buf {
            Some(b) => gpu
                .read_u32(b, 0, (b.size() / 4) as usize)
                .map_err(gpu_err)?,
            None => Vec::new(),
        };
        Ok(self
            .parts
            .iter()
            .map(|p| {
                let Some((start, count)) = *p else {
                    return Vec::new();
                };
                (start..start + count)
                    .map(|r| RowTop1 {
                        id: Some(words[2 * r])
                            .filter(|&i| i != nextn_gpu::kernels::argmax::NO_INDEX),
                        logit: f32::from_bits(words[2 * r + 1]),
                    })
                    .collect()
            })
            .collect())
    }
}

/// The logits rows of the parts read back whole, per part (empty for a top-1 part), `width`
/// floats a row; a trimmed LM head's rows (`trimmed`) are scattered to the full vocabulary.
pub(crate) fn read_rows_back(
    gpu: &Gpu,
    logits: &wgpu::Buffer,
    width: usize,
    ranges: &[(usize, usize)],
    readbacks: &[Readback],
    trimmed: Option<&crate::draft_vocab::DraftLmHead>,
) -> Result<Vec<Vec<f32>>, ModelError> {
    ranges
        .iter()
        .zip(readbacks)
        .map(|(&(start, count), &rb)| {
            if rb == Readback::Top1 || count == 0 {
                return Ok(Vec::new());
            }
            let rows = gpu
                .read_f32(logits, (start * width) as u64, count * width)
                .map_err(gpu_err)?;
            Ok(match trimmed {
                Some(d) => d.scatter(&rows, count),
                None => rows,
            })
        })
        .collect()
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

/// What the device did since the counters were last reset: passes (target, head and commit
/// submissions), the dispatches they recorded, and, when timing is on, the device time the
/// passes took by timestamp queries.
#[derive(Clone, Debug, Default)]
pub struct DeviceStats {
    pub passes: u64,
    pub dispatches: u64,
    /// Bytes the forward passes read back: hidden rows, logits rows and top-1 rows.
    pub read_back_bytes: u64,
    pub timed_passes: u64,
    pub gpu_seconds: f64,
    /// With profiling on: device time by kernel over the passes whose dispatches were timed.
    pub kernels: std::collections::BTreeMap<&'static str, KernelTime>,
    /// The device time of the passes whose dispatches were timed (the kernels' times add up to it).
    pub profiled_seconds: f64,
}

/// One kernel's share of the profiled passes.
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelTime {
    pub dispatches: u64,
    pub seconds: f64,
}

/// The counters a model and its head share; timing costs a read-back per pass, so it is on only
/// when asked for (`nextn bench`).
#[derive(Default)]
pub(crate) struct Counters {
    stats: std::sync::Mutex<DeviceStats>,
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

    /// Submit `rec`, counting it.
    pub(crate) fn submit(&self, rec: Recorder) -> Result<(), ModelError> {
        let dispatches = rec.len() as u64;
        let order = std::sync::atomic::Ordering::Relaxed;
        let timing = if self.profiling.load(order) {
            nextn_gpu::Timing::Dispatches
        } else if self.timing.load(order) {
            nextn_gpu::Timing::Pass
        } else {
            nextn_gpu::Timing::Off
        };
        let t = rec.submit_timed(timing).map_err(gpu_err)?;
        if let Ok(mut s) = self.stats.lock() {
            s.passes += 1;
            s.dispatches += dispatches;
            if let Some(t) = t {
                s.timed_passes += 1;
                s.gpu_seconds += t.seconds;
                if !t.dispatches.is_empty() {
                    s.profiled_seconds += t.seconds;
                }
                for (kernel, secs) in t.dispatches {
                    let k = s.kernels.entry(kernel).or_default();
                    k.dispatches += 1;
                    k.seconds += secs;
                }
            }
        }
        Ok(())
    }
}

/// The trunk on the device.
pub struct DeviceModel {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) layers: Vec<DeviceLayer>,
    output_norm: wgpu::Buffer,
    lm_head: Arc<Mat>,
    bytes: u64,
}

impl DeviceModel {
    /// Upload every trunk weight of `model` (the embedding table stays in host memory).
    pub fn upload(model: &Model, gpu: Arc<Gpu>) -> Result<DeviceModel, ModelError> {
        let cfg = &model.config;
        let mut bytes = 0;
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            let d = DeviceLayer::upload(&gpu, l, cfg)?;
            bytes += d.device_bytes();
            layers.push(d);
        }
        let lm_head = Arc::new(Mat::upload(&gpu, &model.lm_head)?);
        bytes += lm_head.device_bytes();
        let output_norm = vector(&gpu, "output_norm", &model.output_norm)?;
        gpu.check().map_err(gpu_err)?;
        Ok(DeviceModel {
            gpu,
            counters: Arc::new(Counters::default()),
            layers,
            output_norm,
            lm_head,
            bytes,
        })
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

    /// The counters since the last call, which resets them.
    pub fn take_stats(&self) -> DeviceStats {
        self.counters
            .stats
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
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
        self.layers
            .iter()
            .enumerate()
            .map(|(il, l)| l.new_cache(&self.gpu, &model.config, il, n_ctx, k_type, v_type))
            .collect()
    }

    /// [`Model::forward_batch`] on the device.
    pub(crate) fn forward_batch(
        &self,
        model: &Model,
        items: &mut [BatchItem],
    ) -> Result<Vec<ForwardOutput>, ModelError> {
        let gpu = &*self.gpu;
        let cfg = &model.config;
        let e = cfg.n_embd;
        let mut tokens = Vec::new();
        let mut starts = Vec::with_capacity(items.len());
        for it in items.iter() {
            starts.push(tokens.len());
            tokens.extend_from_slice(it.tokens);
        }
        let n = tokens.len();
        let n_vocab = model.n_vocab;
        if n == 0 {
            return Ok(items
                .iter()
                .map(|_| ForwardOutput::empty(n_vocab))
                .collect());
        }
        let h_host = model.embed(&tokens)?;
        let h = gpu
            .upload("h", bytemuck::cast_slice(&h_host))
            .map_err(gpu_err)?;
        let mut pass = layer::PassBuffers::new(&self.gpu, cfg, n)?;
        let mut rec = Recorder::new(gpu);
        for (il, layer) in self.layers.iter().enumerate() {
            let mut segments = Vec::new();
            for (it, &s) in items.iter_mut().zip(&starts) {
                if it.tokens.is_empty() {
                    continue;
                }
                segments.push(Segment {
                    rows: s..s + it.tokens.len(),
                    start_pos: it.state.n_past,
                    cache: &mut it.state.layers[il],
                    verify: it.verify,
                    positions: crate::ops::RowPositions::default(),
                });
            }
            layer.forward(&mut rec, &h, n, &mut segments, &mut pass)?;
        }
        let hidden = scratch(gpu, "hidden", n * e)?;
        rms_norm(
            &mut rec,
            &h,
            0,
            &self.output_norm,
            0,
            &hidden,
            0,
            u(n)?,
            u(e)?,
            u(e)?,
            cfg.rms_eps,
        )
        .map_err(gpu_err)?;
        // One LM-head product over every requested row of every sequence.
        let (picked, ranges) = logit_rows(
            items
                .iter()
                .zip(&starts)
                .map(|(it, &s)| (s, it.tokens.len(), it.logits)),
        );
        let n_picked = picked.len();
        let logits_buf = scratch(gpu, "logits", n_picked * n_vocab)?;
        if n_picked > 0 {
            let idx = gpu
                .upload("picked", bytemuck::cast_slice(&picked))
                .map_err(gpu_err)?;
            let rows = scratch(gpu, "picked-rows", n_picked * e)?;
            gather_rows(&mut rec, &hidden, &idx, &rows, u(n_picked)?, u(e)?).map_err(gpu_err)?;
            self.lm_head
                .forward(&mut rec, &rows, 0, e, n_picked, &logits_buf, 0, n_vocab)?;
        }
        let readbacks: Vec<Readback> = items.iter().map(|it| it.readback).collect();
        let top1 = Top1Rows::record(&mut rec, &logits_buf, n_vocab, &ranges, &readbacks)?;
        self.counters.submit(rec)?;
        let hidden_host = gpu.read_f32(&hidden, 0, n * e).map_err(gpu_err)?;
        let rows_back = read_rows_back(gpu, &logits_buf, n_vocab, &ranges, &readbacks, None)?;
        let top1 = top1.read(gpu)?;
        self.counters
            .read_back(read_bytes(n * e, &ranges, &readbacks, n_vocab));
        let mut outs = Vec::with_capacity(items.len());
        let back = rows_back.into_iter().zip(top1);
        for ((it, &s), (logits, top1)) in items.iter_mut().zip(&starts).zip(back) {
            let len = it.tokens.len();
            it.state.n_past += len;
            if it.verify {
                it.state.pending_rows = len;
            }
            outs.push(ForwardOutput {
                hidden: hidden_host[s * e..(s + len) * e].to_vec(),
                logits,
                n_vocab,
                top1,
            });
        }
        Ok(outs)
    }

    /// [`Model::commit`] on the device: keep `keep` of the pending rows.
    pub(crate) fn commit(&self, state: &mut SequenceState, keep: usize) -> Result<(), ModelError> {
        let pending = state.pending_rows;
        let mut rec = Recorder::new(&self.gpu);
        for (layer, cache) in self.layers.iter().zip(state.layers.iter_mut()) {
            layer.commit(&mut rec, cache, keep, pending)?;
        }
        self.counters.submit(rec)?;
        Ok(())
    }
}

/// What `-dev` / `-ngl` choose: a device to open, or the CPU. `NEXTN_GPU_INT8=0` keeps the
/// quantized products on f32 activations where the adapter has int8 dot products (for
/// comparisons; the load line says which path runs). `NEXTN_GPU_MEMORY_MIB` caps the device
/// memory weights and caches may take (the device's own memory otherwise).
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
    })
    .map_err(gpu_err)?;
    if std::env::var("NEXTN_GPU_INT8").as_deref() == Ok("0") {
        gpu.disable_int8_dot();
    }
    Ok(Arc::new(gpu))
}
