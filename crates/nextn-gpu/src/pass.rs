//! Recording device work into one submission: dispatches (each kernel's parameters in one uniform
//! buffer shared by every submission, bound at a dynamic offset; its buffers in a bind group made
//! once and reused), copies and uploads in program order, and what the host reads back, all in
//! one command buffer with at most one wait for the device.
//!
//! Work can also be recorded now and submitted later ([`Recorder::defer`]): it then runs first in
//! the next submission, or before any read, write or copy the host asks for, so a commit recorded
//! after one pass costs no submission of its own.

use std::sync::Arc;

use crate::context::{CounterCells, Gpu, Pipeline, PARAMS_WINDOW};
use crate::kernels::Kernel;
use crate::GpuError;

/// One recorded command.
enum Op {
    Dispatch {
        kernel: &'static str,
        pipeline: Arc<Pipeline>,
        group: wgpu::BindGroup,
        /// Byte offset of the parameters in the recording's parameter blob.
        params: u64,
        groups: [u32; 3],
        /// The fewest bytes the dispatch moves through device memory.
        bytes: u64,
    },
    Copy {
        src: wgpu::Buffer,
        src_offset: u64,
        dst: wgpu::Buffer,
        dst_offset: u64,
        bytes: u64,
    },
    /// `bytes` of the recording's upload blob from `data` to `dst` at `dst_offset`.
    Upload {
        data: u64,
        dst: wgpu::Buffer,
        dst_offset: u64,
        bytes: u64,
    },
}

/// Commands recorded and not yet submitted, with the parameters and uploaded data they refer to.
#[derive(Default)]
pub(crate) struct Recorded {
    ops: Vec<Op>,
    params: Vec<u8>,
    uploads: Vec<u8>,
    dispatches: usize,
}

impl Recorded {
    pub(crate) fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// `other`'s commands after these.
    fn append(&mut self, other: Recorded) {
        // Every dispatch's parameters start at a multiple of the window, as dynamic offsets must.
        let p0 = (self.params.len() as u64).next_multiple_of(PARAMS_WINDOW);
        self.params.resize(p0 as usize, 0);
        let u0 = self.uploads.len() as u64;
        self.params.extend_from_slice(&other.params);
        self.uploads.extend_from_slice(&other.uploads);
        self.dispatches += other.dispatches;
        self.ops.extend(other.ops.into_iter().map(|op| match op {
            Op::Dispatch {
                kernel,
                pipeline,
                group,
                params,
                groups,
                bytes,
            } => Op::Dispatch {
                kernel,
                pipeline,
                group,
                params: params + p0,
                groups,
                bytes,
            },
            Op::Upload {
                data,
                dst,
                dst_offset,
                bytes,
            } => Op::Upload {
                data: data + u0,
                dst,
                dst_offset,
                bytes,
            },
            copy => copy,
        }));
    }
}

/// How a submission is timed on the device (when it has timestamp queries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    Off,
    /// The whole pass.
    Pass,
    /// The pass and each dispatch in it (where the device can write timestamps inside a pass;
    /// elsewhere the pass only).
    Dispatches,
}

/// The device time of one submission.
#[derive(Clone, Debug, Default)]
pub struct PassTime {
    pub seconds: f64,
    /// With [`Timing::Dispatches`]: each dispatch, in order.
    pub dispatches: Vec<DispatchTime>,
}

/// One timed dispatch: its kernel, its time (from the end of the dispatch before it, so the
/// barrier between them is counted too), the fewest bytes it moves through device memory (each
/// input read once, each output written once), whose ratio is its achieved bandwidth, and the
/// workgroups it launched (to set against the device's compute units).
#[derive(Clone, Copy, Debug)]
pub struct DispatchTime {
    pub kernel: &'static str,
    pub seconds: f64,
    pub bytes: u64,
    pub workgroups: u64,
}

/// The most timestamps one submission writes.
const MAX_QUERIES: usize = 4096;

/// Where one read-back lands among a submission's ([`Recorder::read_back`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadSlot(usize);

/// What a submission read back: each [`ReadSlot`]'s bytes, and its time when it was timed.
#[derive(Debug, Default)]
pub struct ReadBack {
    data: Vec<Vec<u8>>,
    pub time: Option<PassTime>,
}

impl ReadBack {
    /// The bytes of `slot` (taken: a second call gives nothing).
    pub fn take(&mut self, slot: ReadSlot) -> Vec<u8> {
        self.data
            .get_mut(slot.0)
            .map(std::mem::take)
            .unwrap_or_default()
    }

    pub fn f32s(&mut self, slot: ReadSlot) -> Vec<f32> {
        bytemuck::pod_collect_to_vec(&self.take(slot))
    }

    pub fn u32s(&mut self, slot: ReadSlot) -> Vec<u32> {
        bytemuck::pod_collect_to_vec(&self.take(slot))
    }
}

/// Work waiting to be submitted together.
pub struct Recorder<'g> {
    gpu: &'g Gpu,
    rec: Recorded,
    reads: Vec<(wgpu::Buffer, u64, u64)>,
}

/// Workgroup counts for `n` groups along one logical axis: `[x, y, 1]` with `x` within the
/// device's per-dimension limit. A kernel recovers its group as `wid.x + wid.y * nwg.x` and
/// returns when that is `>= n` (the last row of groups may be partial).
pub fn groups_1d(gpu: &Gpu, n: u32) -> [u32; 3] {
    let max = gpu.max_groups_x().max(1);
    if n <= max {
        [n.max(1), 1, 1]
    } else {
        let y = n.div_ceil(max);
        [n.div_ceil(y), y, 1]
    }
}

/// Byte offsets of read-backs in the staging buffer are multiples of this (wgpu's map
/// alignment).
const MAP_ALIGN: u64 = 8;

impl<'g> Recorder<'g> {
    pub fn new(gpu: &'g Gpu) -> Self {
        Recorder {
            gpu,
            rec: Recorded::default(),
            reads: Vec::new(),
        }
    }

    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Number of dispatches recorded so far.
    pub fn len(&self) -> usize {
        self.rec.dispatches
    }

    pub fn is_empty(&self) -> bool {
        self.rec.ops.is_empty() && self.reads.is_empty()
    }

    /// Record `kernel` over `groups` workgroups. `params` fill the kernel's uniform struct
    /// (u32 words; f32 values as their bits); `buffers` are its storage bindings 1, 2, ... in
    /// order, each bound whole (kernels take element offsets in their parameters). `bytes`: the
    /// fewest bytes the dispatch moves through device memory (each input read once, each output
    /// written once), which a profile divides by its time.
    pub fn dispatch(
        &mut self,
        kernel: &'static Kernel,
        params: &[u32],
        buffers: &[&wgpu::Buffer],
        groups: [u32; 3],
        bytes: u64,
    ) -> Result<(), GpuError> {
        if groups.contains(&0) {
            return Ok(());
        }
        if params.len() * 4 > PARAMS_WINDOW as usize {
            return Err(GpuError::Kernel {
                kernel: kernel.name,
                why: format!(
                    "{} parameter words, over {}",
                    params.len(),
                    PARAMS_WINDOW / 4
                ),
            });
        }
        let pipeline = self.gpu.pipeline(kernel)?;
        let group = self
            .gpu
            .bind_group(kernel.name, &pipeline.storage, buffers)?;
        let blob = &mut self.rec.params;
        let offset = (blob.len() as u64).next_multiple_of(PARAMS_WINDOW);
        blob.resize(offset as usize, 0);
        blob.extend_from_slice(bytemuck::cast_slice(params));
        self.rec.ops.push(Op::Dispatch {
            kernel: kernel.name,
            pipeline,
            group,
            params: offset,
            groups,
            bytes,
        });
        self.rec.dispatches += 1;
        Ok(())
    }

    /// Copy `bytes` (a multiple of 4) from `src` at `src_offset` to `dst` at `dst_offset`, in
    /// order with the dispatches.
    pub fn copy(
        &mut self,
        src: &wgpu::Buffer,
        src_offset: u64,
        dst: &wgpu::Buffer,
        dst_offset: u64,
        bytes: u64,
    ) {
        if bytes == 0 {
            return;
        }
        self.rec.ops.push(Op::Copy {
            src: src.clone(),
            src_offset,
            dst: dst.clone(),
            dst_offset,
            bytes,
        });
    }

    /// Write `data` (padded with zeros to a multiple of 4 bytes) into `dst` at `dst_offset`, in
    /// order with the other commands: a kernel recorded before it still sees the old contents.
    pub fn upload(&mut self, dst: &wgpu::Buffer, dst_offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let at = self.rec.uploads.len() as u64;
        self.rec.uploads.extend_from_slice(data);
        let padded = data.len().next_multiple_of(4);
        self.rec.uploads.resize(at as usize + padded, 0);
        self.rec.ops.push(Op::Upload {
            data: at,
            dst: dst.clone(),
            dst_offset,
            bytes: padded as u64,
        });
    }

    /// Read `bytes` (a multiple of 4) of `buf` from byte `offset` after everything recorded:
    /// [`Recorder::submit_read`] returns them under the slot.
    pub fn read_back(&mut self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> ReadSlot {
        self.reads.push((buf.clone(), offset, bytes));
        ReadSlot(self.reads.len() - 1)
    }

    /// Submit nothing now: what is recorded runs first in the next submission, or before the
    /// next read, write or copy of the host's. A recording with read-backs cannot wait.
    pub fn defer(self) -> Result<(), GpuError> {
        if !self.reads.is_empty() {
            return Err(GpuError::ReadBack(
                "work with read-backs cannot be deferred".into(),
            ));
        }
        let mut pending = self
            .gpu
            .pending
            .lock()
            .map_err(|_| GpuError::Device("deferred work poisoned".into()))?;
        pending.append(self.rec);
        Ok(())
    }

    /// Run everything recorded. With `timed` and a device that has timestamp queries, returns
    /// the seconds the device spent on the pass (waiting for it).
    pub fn submit(self, timed: bool) -> Result<Option<f64>, GpuError> {
        let timing = if timed { Timing::Pass } else { Timing::Off };
        Ok(self.submit_timed(timing)?.map(|t| t.seconds))
    }

    /// Run everything recorded, timed as `timing` asks where the device can.
    pub fn submit_timed(self, timing: Timing) -> Result<Option<PassTime>, GpuError> {
        Ok(self.submit_read(timing)?.time)
    }

    /// Run everything recorded, after the work deferred before it, in one submission; when
    /// anything is read back or timed, wait once for the device and return it.
    pub fn submit_read(self, timing: Timing) -> Result<ReadBack, GpuError> {
        let gpu = self.gpu;
        let mut all = std::mem::take(
            &mut *gpu
                .pending
                .lock()
                .map_err(|_| GpuError::Device("deferred work poisoned".into()))?,
        );
        all.append(self.rec);
        let reads = self.reads;
        if all.ops.is_empty() && reads.is_empty() {
            return Ok(ReadBack::default());
        }
        let dispatches = all.dispatches;
        let timing = if dispatches == 0 || !gpu.has_timestamps() {
            Timing::Off
        } else {
            timing
        };
        let per_dispatch = timing == Timing::Dispatches
            && gpu.has_dispatch_timestamps()
            && dispatches < MAX_QUERIES;
        let mut arena = gpu
            .arena
            .lock()
            .map_err(|_| GpuError::Device("submission buffers poisoned".into()))?;
        let params = arena.params(gpu, &all.params)?;
        let uploads = if all.uploads.is_empty() {
            None
        } else {
            Some(arena.uploads(gpu, &all.uploads)?)
        };
        // Pass timing: a timestamp at the start and one at the end; per dispatch: one before the
        // first and one after each.
        let queries = match timing {
            Timing::Off => 0,
            _ if per_dispatch => dispatches as u32 + 1,
            _ => 2,
        };
        let query_set = if queries > 0 {
            Some(arena.queries(gpu, queries)?)
        } else {
            None
        };
        // Read-backs, then the resolved timestamps, one after another in the staging buffer.
        let mut layout = Vec::with_capacity(reads.len());
        let mut end = 0u64;
        for (_, _, bytes) in &reads {
            layout.push(end);
            end = (end + bytes).next_multiple_of(MAP_ALIGN);
        }
        let time_at = end;
        end += queries as u64 * 8;
        let staging = if end > 0 {
            Some(arena.staging(gpu, end)?)
        } else {
            None
        };

        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("pass"),
            });
        let n_ops = all.ops.len();
        let last_dispatch = all
            .ops
            .iter()
            .rposition(|op| matches!(op, Op::Dispatch { .. }));
        let mut seen_dispatch = false;
        let mut kernels = Vec::with_capacity(if per_dispatch { dispatches } else { 0 });
        let mut i = 0;
        while i < n_ops {
            match &all.ops[i] {
                Op::Copy {
                    src,
                    src_offset,
                    dst,
                    dst_offset,
                    bytes,
                } => {
                    enc.copy_buffer_to_buffer(src, *src_offset, dst, *dst_offset, *bytes);
                    i += 1;
                }
                Op::Upload {
                    data,
                    dst,
                    dst_offset,
                    bytes,
                } => {
                    if let Some(u) = &uploads {
                        enc.copy_buffer_to_buffer(u, *data, dst, *dst_offset, *bytes);
                    }
                    i += 1;
                }
                Op::Dispatch { .. } => {
                    // A compute pass over the run of dispatches from here.
                    let run_end = all.ops[i..]
                        .iter()
                        .position(|op| !matches!(op, Op::Dispatch { .. }))
                        .map_or(n_ops, |p| i + p);
                    let first_run = !seen_dispatch;
                    let last_run = last_dispatch.is_some_and(|l| l < run_end);
                    let writes = query_set
                        .as_ref()
                        .filter(|_| !per_dispatch && (first_run || last_run))
                        .map(|(set, _)| wgpu::ComputePassTimestampWrites {
                            query_set: set,
                            beginning_of_pass_write_index: first_run.then_some(0),
                            end_of_pass_write_index: last_run.then_some(1),
                        });
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("kernels"),
                        timestamp_writes: writes,
                    });
                    let inside = query_set
                        .as_ref()
                        .filter(|_| per_dispatch)
                        .map(|(set, _)| set);
                    if let (Some(set), true) = (inside, first_run) {
                        pass.write_timestamp(set, 0);
                    }
                    for op in &all.ops[i..run_end] {
                        let Op::Dispatch {
                            kernel,
                            pipeline,
                            group,
                            params: offset,
                            groups,
                            bytes,
                        } = op
                        else {
                            continue;
                        };
                        pass.set_pipeline(&pipeline.compute);
                        pass.set_bind_group(0, group, &[]);
                        pass.set_bind_group(1, &params, &[*offset as u32]);
                        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                        if let Some(set) = inside {
                            let workgroups = groups.iter().map(|&g| g as u64).product();
                            kernels.push((*kernel, *bytes, workgroups));
                            pass.write_timestamp(set, kernels.len() as u32);
                        }
                    }
                    seen_dispatch = true;
                    i = run_end;
                }
            }
        }
        if let Some(staging) = &staging {
            for ((buf, offset, bytes), at) in reads.iter().zip(&layout) {
                enc.copy_buffer_to_buffer(buf, *offset, staging, *at, *bytes);
            }
            if let Some((set, resolve)) = &query_set {
                enc.resolve_query_set(set, 0..queries, resolve, 0);
                enc.copy_buffer_to_buffer(resolve, 0, staging, time_at, queries as u64 * 8);
            }
        }
        gpu.queue.submit([enc.finish()]);
        CounterCells::add(&gpu.counters.submissions, 1);
        CounterCells::add(&gpu.counters.dispatches, dispatches as u64);
        gpu.tick();
        gpu.check()?;
        let Some(staging) = staging else {
            return Ok(ReadBack::default());
        };
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, 0..end, move |r| {
            let _ = tx.send(r);
        });
        CounterCells::add(&gpu.counters.read_backs, 1);
        gpu.poll_wait()?;
        rx.recv()
            .map_err(|_| GpuError::ReadBack("the map callback never ran".into()))?
            .map_err(|e| GpuError::ReadBack(e.to_string()))?;
        let view = staging
            .get_mapped_range(0..end)
            .map_err(|e| GpuError::ReadBack(e.to_string()))?;
        let data: Vec<Vec<u8>> = reads
            .iter()
            .zip(&layout)
            .map(|((_, _, bytes), &at)| view[at as usize..(at + bytes) as usize].to_vec())
            .collect();
        let ticks: Vec<u64> = if queries > 0 {
            bytemuck::pod_collect_to_vec(&view[time_at as usize..end as usize])
        } else {
            Vec::new()
        };
        drop(view);
        staging.unmap();
        drop(arena);
        gpu.check()?;
        let time = (!ticks.is_empty()).then(|| {
            let period = gpu.queue.get_timestamp_period() as f64 * 1e-9;
            let secs = |a: u64, b: u64| b.saturating_sub(a) as f64 * period;
            let (first, last) = (ticks[0], ticks[ticks.len() - 1]);
            PassTime {
                seconds: secs(first, last),
                dispatches: kernels
                    .iter()
                    .zip(ticks.windows(2))
                    .map(|(&(kernel, bytes, workgroups), w)| DispatchTime {
                        kernel,
                        seconds: secs(w[0], w[1]),
                        bytes,
                        workgroups,
                    })
                    .collect(),
            }
        });
        Ok(ReadBack { data, time })
    }
}
