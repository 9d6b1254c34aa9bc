//! The device: adapters as llama.cpp names them (`Vulkan0`, `Metal0`, ...), one opened device with
//! its queue, buffers, blocking read-back, and the pipelines of the WGSL kernels, built once each.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::kernels::Kernel;
use crate::GpuError;

/// One adapter the machine offers, named as llama.cpp's `--list-devices` names it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// `Vulkan0`, `Metal0`, `DX12_0`: the backend's name and the adapter's index within it.
    pub name: String,
    /// The adapter's own name (`llvmpipe (LLVM 15.0.7, 256 bits)`, `NVIDIA H200`).
    pub description: String,
    /// Driver and its version as the adapter reports them.
    pub driver: String,
    pub device_type: wgpu::DeviceType,
    /// Whether this is a CPU implementation of the API (lavapipe, WARP): its timings are software.
    pub software: bool,
    /// The largest single storage binding the adapter allows, in bytes.
    pub max_binding_bytes: u64,
    /// Whether quantized products take int8 activations with packed 4 x 8-bit integer dot
    /// products (`dot4I8Packed`): a Vulkan adapter of version 1.3 or with
    /// VK_KHR_shader_integer_dot_product. Elsewhere naga would emulate the instruction, so the
    /// f32-activation kernels run.
    pub int8_dot: bool,
    /// The largest device-local memory heap, in bytes, where the API reports one (Vulkan): what
    /// the weights and the caches of every sequence must fit in together.
    pub memory_bytes: Option<u64>,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.name, self.description)?;
        if !self.driver.is_empty() {
            write!(f, " ({})", self.driver)?;
        }
        if self.software {
            write!(f, " [software]")?;
        }
        write!(
            f,
            ", int8 dot: {}",
            if self.int8_dot { "yes" } else { "no" }
        )
    }
}

fn backend_prefix(b: wgpu::Backend) -> &'static str {
    match b {
        wgpu::Backend::Vulkan => "Vulkan",
        wgpu::Backend::Metal => "Metal",
        wgpu::Backend::Dx12 => "DX12_",
        wgpu::Backend::Gl => "GL",
        _ => "GPU",
    }
}

fn instance(validation: bool) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    desc.flags = if validation {
        // Validation without DEBUG: DEBUG makes naga write the WGSL source into the SPIR-V
        // (OpSource language 10), which validation layers older than 1.3.250 reject.
        wgpu::InstanceFlags::VALIDATION | wgpu::InstanceFlags::VALIDATION_INDIRECT_CALL
    } else {
        wgpu::InstanceFlags::empty()
    }
    .with_env();
    wgpu::Instance::new(desc)
}

/// Adapters with their llama.cpp-style names, in the order the backends list them.
fn adapters(inst: &wgpu::Instance) -> Vec<(DeviceInfo, wgpu::Adapter)> {
    let all = pollster::block_on(inst.enumerate_adapters(inst_backends()));
    let mut count: HashMap<wgpu::Backend, usize> = HashMap::new();
    let mut out = Vec::new();
    for a in all {
        let info = a.get_info();
        if info.device_type == wgpu::DeviceType::Other && info.backend != wgpu::Backend::Vulkan {
            continue;
        }
        let idx = count.entry(info.backend).or_insert(0);
        let name = format!("{}{}", backend_prefix(info.backend), *idx);
        *idx += 1;
        let driver = [info.driver.as_str(), info.driver_info.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        out.push((
            DeviceInfo {
                name,
                description: info.name.clone(),
                driver,
                device_type: info.device_type,
                software: info.device_type == wgpu::DeviceType::Cpu,
                max_binding_bytes: a.limits().max_storage_buffer_binding_size,
                int8_dot: has_int8_dot(&a),
                memory_bytes: device_memory(&a),
            },
            a,
        ));
    }
    out
}

/// Whether the adapter runs `dot4I8Packed` as an instruction: wgpu hands naga the SPIR-V
/// integer dot product capabilities exactly when the Vulkan device has the feature, which
/// Vulkan 1.3 and VK_KHR_shader_integer_dot_product require.
fn has_int8_dot(a: &wgpu::Adapter) -> bool {
    // SAFETY: the Vulkan adapter is only read (its properties), not used to create anything.
    let Some(hal) = (unsafe { a.as_hal::<wgpu::hal::api::Vulkan>() }) else {
        return false;
    };
    let caps = hal.physical_device_capabilities();
    let v = caps.properties().api_version;
    let (major, minor) = (v >> 22 & 0x7f, v >> 12 & 0x3ff);
    (major, minor) >= (1, 3) || caps.supports_extension(c"VK_KHR_shader_integer_dot_product")
}

/// The largest device-local heap of a Vulkan adapter.
fn device_memory(a: &wgpu::Adapter) -> Option<u64> {
    // SAFETY: as in `has_int8_dot`, the adapter's properties are only read.
    let hal = unsafe { a.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let instance = hal.shared_instance().raw_instance();
    // SAFETY: the physical device belongs to this instance, which outlives the call.
    let props =
        unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
    props
        .memory_heaps_as_slice()
        .iter()
        .filter(|h| h.flags.contains(ash::vk::MemoryHeapFlags::DEVICE_LOCAL))
        .map(|h| h.size)
        .max()
}

fn inst_backends() -> wgpu::Backends {
    wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12
}

/// Every adapter this machine offers for compute.
pub fn list_devices() -> Vec<DeviceInfo> {
    adapters(&instance(false))
        .into_iter()
        .map(|(d, _)| d)
        .collect()
}

/// What the device reported through wgpu's error handler; a kernel that breaks a rule of the API
/// ends up here (and, with validation on, in the Vulkan validation layer's messages).
#[derive(Default)]
struct ErrorLog {
    messages: Mutex<Vec<String>>,
}

/// An opened device and its queue.
pub struct Gpu {
    pub info: DeviceInfo,
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) limits: wgpu::Limits,
    timestamps: bool,
    dispatch_timestamps: bool,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    errors: Arc<ErrorLog>,
    budget: Arc<MemoryBudget>,
}

/// How to open a device.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// `-dev NAME`: the adapter's llama.cpp name (`Vulkan0`); `None` takes the first one.
    pub name: Option<String>,
    /// Turn on the API's validation (the Vulkan validation layer): slower, for tests.
    pub validation: bool,
    /// Device memory the weights and caches may take together, in bytes; `None`: the adapter's
    /// device-local heap ([`DeviceInfo::memory_bytes`]), or no limit where none is reported.
    pub memory_budget: Option<u64>,
}

/// Device memory that weights and caches have reserved, against a budget: a cache or a matrix
/// that would not fit is refused before anything is allocated, with what it needed.
#[derive(Debug)]
struct MemoryBudget {
    limit: Option<u64>,
    used: AtomicU64,
}

/// Device memory held for a matrix or a cache; it goes back to the budget when this is dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Gpu {
    /// Open the adapter `opts.name` (or the first one).
    pub fn open(opts: &OpenOptions) -> Result<Gpu, GpuError> {
        let inst = instance(opts.validation);
        let list = adapters(&inst);
        if list.is_empty() {
            return Err(GpuError::NoAdapter);
        }
        let names: Vec<String> = list.iter().map(|(d, _)| d.name.clone()).collect();
        let (info, adapter) = match &opts.name {
            None => list.into_iter().next().ok_or(GpuError::NoAdapter)?,
            Some(want) => list
                .into_iter()
                .find(|(d, _)| d.name.eq_ignore_ascii_case(want))
                .ok_or_else(|| GpuError::UnknownDevice {
                    name: want.clone(),
                    available: names.join(", "),
                })?,
        };
        let info_memory = info.memory_bytes;
        let adapter_limits = adapter.limits();
        // Everything the adapter offers that compute kernels use: large bindings, many storage
        // buffers per kernel, big workgroups and workgroup memory.
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: adapter_limits.max_storage_buffer_binding_size,
            max_buffer_size: adapter_limits.max_buffer_size,
            max_storage_buffers_per_shader_stage: adapter_limits
                .max_storage_buffers_per_shader_stage
                .min(16),
            max_compute_workgroup_storage_size: adapter_limits.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: adapter_limits
                .max_compute_invocations_per_workgroup,
            max_compute_workgroup_size_x: adapter_limits.max_compute_workgroup_size_x,
            max_compute_workgroup_size_y: adapter_limits.max_compute_workgroup_size_y,
            max_compute_workgroups_per_dimension: adapter_limits
                .max_compute_workgroups_per_dimension,
            ..wgpu::Limits::downlevel_defaults()
        };
        let mut features = wgpu::Features::empty();
        let timestamps = adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        if timestamps {
            features |= wgpu::Features::TIMESTAMP_QUERY;
        }
        // Timestamps between the dispatches of a pass, for `nextn bench --device-profile`; asking
        // for them costs nothing until a pass writes them.
        let dispatch_timestamps = timestamps
            && adapter
                .features()
                .contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);
        if dispatch_timestamps {
            features |= wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("nextn"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| GpuError::Device(e.to_string()))?;
        let errors = Arc::new(ErrorLog::default());
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut m) = sink.messages.lock() {
                m.push(e.to_string());
            }
        }));
        Ok(Gpu {
            info,
            device,
            queue,
            limits,
            timestamps,
            dispatch_timestamps,
            pipelines: Mutex::new(HashMap::new()),
            errors,
            budget: Arc::new(MemoryBudget {
                limit: opts.memory_budget.or(info_memory),
                used: AtomicU64::new(0),
            }),
        })
    }

    /// Whether passes can be timed on the device (timestamp queries).
    pub fn has_timestamps(&self) -> bool {
        self.timestamps
    }

    /// Whether each dispatch of a pass can be timed (timestamp queries inside passes).
    pub fn has_dispatch_timestamps(&self) -> bool {
        self.dispatch_timestamps
    }

    /// Whether matrices uploaded from now on take int8 activations where their type allows
    /// ([`DeviceInfo::int8_dot`], unless turned off).
    pub fn int8_dot(&self) -> bool {
        self.info.int8_dot
    }

    /// Keep every matrix uploaded from now on on the f32-activation path (for comparisons);
    /// [`DeviceInfo::int8_dot`] then says "no", the path that runs.
    pub fn disable_int8_dot(&mut self) {
        self.info.int8_dot = false;
    }

    /// The largest buffer one kernel binding may see, in bytes.
    pub fn max_binding_bytes(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size
    }

    /// The most workgroups one dispatch may have along x.
    pub fn max_groups_x(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
    }

    /// Errors the device has reported since the last call (empty when all is well).
    pub fn take_errors(&self) -> Vec<String> {
        self.errors
            .messages
            .lock()
            .map(|mut m| std::mem::take(&mut *m))
            .unwrap_or_default()
    }

    /// The memory budget in bytes (`None`: unlimited) and how much of it is reserved.
    pub fn memory_budget(&self) -> (Option<u64>, u64) {
        (self.budget.limit, self.budget.used.load(Ordering::Relaxed))
    }

    /// Reserve `bytes` of the memory budget for `what` (a matrix, a cache), before allocating
    /// its buffers; refused when the budget cannot hold it beside what is already reserved.
    pub fn reserve(&self, what: &str, bytes: u64) -> Result<Reservation, GpuError> {
        let b = &self.budget;
        let mut used = b.used.load(Ordering::Relaxed);
        loop {
            let after = used.saturating_add(bytes);
            if let Some(limit) = b.limit.filter(|&l| after > l) {
                return Err(GpuError::OverBudget {
                    what: what.to_string(),
                    bytes,
                    used,
                    budget: limit,
                });
            }
            match b
                .used
                .compare_exchange_weak(used, after, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Ok(Reservation {
                        budget: b.clone(),
                        bytes,
                    })
                }
                Err(now) => used = now,
            }
        }
    }

    /// A zeroed storage buffer of `bytes` (rounded up to 4), readable and writable by kernels and
    /// by copies. A device that cannot allocate it is an error naming `label` and the size, and
    /// leaves no invalid buffer behind to fail later kernels.
    pub fn buffer(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        let size = bytes.max(4).div_ceil(4) * 4;
        if size > self.limits.max_buffer_size {
            return Err(GpuError::BufferTooLarge {
                what: label.to_string(),
                bytes: size,
                limit: self.limits.max_buffer_size,
            });
        }
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let out_of_memory = pollster::block_on(oom.pop());
        let invalid = pollster::block_on(validation.pop());
        if let Some(e) = out_of_memory {
            buf.destroy();
            return Err(GpuError::OutOfMemory {
                what: label.to_string(),
                bytes: size,
                why: e.to_string(),
            });
        }
        if let Some(e) = invalid {
            buf.destroy();
            return Err(GpuError::Device(format!(
                "allocating {label} ({size} bytes): {e}"
            )));
        }
        Ok(buf)
    }

    /// A storage buffer holding `data` (padded with zeros to a multiple of 4 bytes).
    pub fn upload(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer, GpuError> {
        let buf = self.buffer(label, data.len() as u64)?;
        self.write(&buf, 0, data);
        Ok(buf)
    }

    /// Write `data` at byte `offset` of `buf` (ordered before the next submission).
    pub fn write(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if data.len().is_multiple_of(4) {
            self.queue.write_buffer(buf, offset, data);
        } else {
            let mut padded = data.to_vec();
            padded.resize(data.len().div_ceil(4) * 4, 0);
            self.queue.write_buffer(buf, offset, &padded);
        }
    }

    pub fn write_f32(&self, buf: &wgpu::Buffer, offset_elems: u64, data: &[f32]) {
        self.write(buf, offset_elems * 4, bytemuck::cast_slice(data));
    }

    pub fn write_u32(&self, buf: &wgpu::Buffer, offset_elems: u64, data: &[u32]) {
        self.write(buf, offset_elems * 4, bytemuck::cast_slice(data));
    }

    /// Copy `bytes` from `src` at `src_offset` to `dst` at `dst_offset` on the device.
    pub fn copy(
        &self,
        src: &wgpu::Buffer,
        src_offset: u64,
        dst: &wgpu::Buffer,
        dst_offset: u64,
        bytes: u64,
    ) {
        if bytes == 0 {
            return;
        }
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("copy"),
            });
        enc.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, bytes);
        self.queue.submit([enc.finish()]);
    }

    /// Read `bytes` of `buf` from byte `offset` (both multiples of 4), waiting for all work
    /// submitted before.
    pub fn read(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>, GpuError> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read-back"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("read-back"),
            });
        enc.copy_buffer_to_buffer(buf, offset, &staging, 0, bytes);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|_| GpuError::ReadBack("the map callback never ran".into()))?
            .map_err(|e| GpuError::ReadBack(e.to_string()))?;
        let out = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| GpuError::ReadBack(e.to_string()))?
            .to_vec();
        staging.unmap();
        self.check()?;
        Ok(out)
    }

    pub fn read_f32(
        &self,
        buf: &wgpu::Buffer,
        offset_elems: u64,
        count: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let bytes = self.read(buf, offset_elems * 4, count as u64 * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    pub fn read_u32(
        &self,
        buf: &wgpu::Buffer,
        offset_elems: u64,
        count: usize,
    ) -> Result<Vec<u32>, GpuError> {
        let bytes = self.read(buf, offset_elems * 4, count as u64 * 4)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Block until every submitted command has run.
    pub fn wait(&self) -> Result<(), GpuError> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::Device(e.to_string()))?;
        Ok(())
    }

    /// An error the device reported, if any, as a `GpuError`.
    pub fn check(&self) -> Result<(), GpuError> {
        let errs = self.take_errors();
        if errs.is_empty() {
            Ok(())
        } else {
            Err(GpuError::Device(errs.join("; ")))
        }
    }

    /// The pipeline of `kernel` with `constants` (WGSL `override`s), built on first use.
    pub(crate) fn pipeline(
        &self,
        kernel: &Kernel,
        constants: &[(&str, f64)],
    ) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
        let mut key = format!("{}:{}", kernel.name, kernel.entry);
        for (k, v) in constants {
            key.push_str(&format!(":{k}={v}"));
        }
        let mut cache = self
            .pipelines
            .lock()
            .map_err(|_| GpuError::Device("pipeline cache poisoned".into()))?;
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(kernel.name),
                source: wgpu::ShaderSource::Wgsl(kernel.source.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(kernel.name),
                layout: None,
                module: &module,
                entry_point: Some(kernel.entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        let errs = self.take_errors();
        if !errs.is_empty() {
            return Err(GpuError::Kernel {
                kernel: kernel.name,
                why: errs.join("; "),
            });
        }
        let p = Arc::new(pipeline);
        cache.insert(key, p.clone());
        Ok(p)
    }
}
