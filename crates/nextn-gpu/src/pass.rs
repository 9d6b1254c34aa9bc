//! Recording kernels into one submission: every dispatch's parameters go into one uniform buffer,
//! written once, and all dispatches run in one compute pass (the API orders their storage
//! accesses: a dispatch sees what the ones before it wrote).

use std::sync::Arc;

use crate::context::Gpu;
use crate::kernels::Kernel;
use crate::GpuError;

/// Uniform buffer offsets must be multiples of this on every backend wgpu supports.
const PARAMS_ALIGN: usize = 256;

struct Dispatch {
    kernel: &'static str,
    pipeline: Arc<wgpu::ComputePipeline>,
    buffers: Vec<wgpu::Buffer>,
    params_offset: u64,
    params_len: u64,
    groups: [u32; 3],
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
    /// With [`Timing::Dispatches`]: each dispatch's kernel and seconds, in order (the time from
    /// the end of the dispatch before it, so the barrier between them is counted too).
    pub dispatches: Vec<(&'static str, f64)>,
}

/// The most timestamps one query set holds in wgpu.
const MAX_QUERIES: usize = 4096;

/// Dispatches waiting to be submitted together.
pub struct Recorder<'g> {
    gpu: &'g Gpu,
    dispatches: Vec<Dispatch>,
    params: Vec<u8>,
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

impl<'g> Recorder<'g> {
    pub fn new(gpu: &'g Gpu) -> Self {
        Recorder {
            gpu,
            dispatches: Vec::new(),
            params: Vec::new(),
        }
    }

    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Number of dispatches recorded so far.
    pub fn len(&self) -> usize {
        self.dispatches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.dispatches.is_empty()
    }

    /// Record `kernel` over `groups` workgroups. `params` fill the kernel's uniform struct at
    /// binding 0 (u32 words; f32 values as their bits); `buffers` are bindings 1, 2, ... in
    /// order, each bound whole (kernels take element offsets in their parameters).
    pub fn dispatch(
        &mut self,
        kernel: &Kernel,
        constants: &[(&str, f64)],
        params: &[u32],
        buffers: &[&wgpu::Buffer],
        groups: [u32; 3],
    ) -> Result<(), GpuError> {
        if groups.contains(&0) {
            return Ok(());
        }
        let pipeline = self.gpu.pipeline(kernel, constants)?;
        let offset = self.params.len().div_ceil(PARAMS_ALIGN) * PARAMS_ALIGN;
        self.params.resize(offset, 0);
        self.params.extend_from_slice(bytemuck::cast_slice(params));
        // A uniform struct's size is a multiple of 16 bytes.
        let len = (params.len() * 4).max(16).div_ceil(16) * 16;
        self.params.resize(offset + len, 0);
        self.dispatches.push(Dispatch {
            kernel: kernel.name,
            pipeline,
            buffers: buffers.iter().map(|b| (*b).clone()).collect(),
            params_offset: offset as u64,
            params_len: len as u64,
            groups,
        });
        Ok(())
    }

    /// Run everything recorded. With `timed` and a device that has timestamp queries, returns
    /// the seconds the device spent on the pass.
    pub fn submit(self, timed: bool) -> Result<Option<f64>, GpuError> {
        let timing = if timed { Timing::Pass } else { Timing::Off };
        Ok(self.submit_timed(timing)?.map(|t| t.seconds))
    }

    /// Run everything recorded, timed as `timing` asks where the device can.
    pub fn submit_timed(self, timing: Timing) -> Result<Option<PassTime>, GpuError> {
        if self.dispatches.is_empty() {
            return Ok(None);
        }
        let gpu = self.gpu;
        let params = gpu.upload("params", &self.params)?;
        let params_uniform = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params-uniform"),
            size: params.size(),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("pass"),
            });
        enc.copy_buffer_to_buffer(&params, 0, &params_uniform, 0, params.size());
        let groups: Vec<wgpu::BindGroup> = self
            .dispatches
            .iter()
            .map(|d| {
                let layout = d.pipeline.get_bind_group_layout(0);
                let mut entries = vec![wgpu::BindGroupEntry {
                    binding: 0,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &params_uniform,
                        offset: d.params_offset,
                        size: std::num::NonZeroU64::new(d.params_len),
                    }),
                }];
                for (i, b) in d.buffers.iter().enumerate() {
                    entries.push(wgpu::BindGroupEntry {
                        binding: i as u32 + 1,
                        resource: b.as_entire_binding(),
                    });
                }
                gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout: &layout,
                    entries: &entries,
                })
            })
            .collect();
        let per_dispatch = timing == Timing::Dispatches
            && gpu.has_dispatch_timestamps()
            && self.dispatches.len() < MAX_QUERIES;
        // Pass timing: a timestamp at the start and one at the end; per dispatch: one before the
        // first and one after each.
        let queries = if per_dispatch {
            self.dispatches.len() + 1
        } else {
            2
        };
        let query_bytes = queries as u64 * 8;
        let timing = if timing != Timing::Off && gpu.has_timestamps() {
            let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("pass-time"),
                ty: wgpu::QueryType::Timestamp,
                count: queries as u32,
            });
            let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("pass-time-resolve"),
                size: query_bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            Some((set, resolve))
        } else {
            None
        };
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("kernels"),
                timestamp_writes: timing.as_ref().filter(|_| !per_dispatch).map(|(set, _)| {
                    wgpu::ComputePassTimestampWrites {
                        query_set: set,
                        beginning_of_pass_write_index: Some(0),
                        end_of_pass_write_index: Some(1),
                    }
                }),
            });
            let inside = timing.as_ref().filter(|_| per_dispatch).map(|(set, _)| set);
            if let Some(set) = inside {
                pass.write_timestamp(set, 0);
            }
            for (i, (d, bg)) in self.dispatches.iter().zip(&groups).enumerate() {
                pass.set_pipeline(&d.pipeline);
                pass.set_bind_group(0, bg, &[]);
                pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
                if let Some(set) = inside {
                    pass.write_timestamp(set, i as u32 + 1);
                }
            }
        }
        let readback = timing.as_ref().map(|(set, resolve)| {
            enc.resolve_query_set(set, 0..queries as u32, resolve, 0);
            let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("pass-time-read"),
                size: query_bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            enc.copy_buffer_to_buffer(resolve, 0, &staging, 0, query_bytes);
            staging
        });
        gpu.queue.submit([enc.finish()]);
        gpu.check()?;
        let Some(staging) = readback else {
            return Ok(None);
        };
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        gpu.wait()?;
        rx.recv()
            .map_err(|_| GpuError::ReadBack("the timestamp map never ran".into()))?
            .map_err(|e| GpuError::ReadBack(e.to_string()))?;
        let view = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| GpuError::ReadBack(e.to_string()))?;
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&view);
        drop(view);
        staging.unmap();
        let period = gpu.queue.get_timestamp_period() as f64 * 1e-9;
        let secs = |a: u64, b: u64| b.saturating_sub(a) as f64 * period;
        let (first, last) = (ticks[0], ticks[ticks.len() - 1]);
        let dispatches = if per_dispatch {
            self.dispatches
                .iter()
                .zip(ticks.windows(2))
                .map(|(d, w)| (d.kernel, secs(w[0], w[1])))
                .collect()
        } else {
            Vec::new()
        };
        Ok(Some(PassTime {
            seconds: secs(first, last),
            dispatches,
        }))
    }
}
