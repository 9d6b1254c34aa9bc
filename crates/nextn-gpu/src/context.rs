//! The device: adapters as llama.cpp names them (`Vulkan0`, `Metal0`, ...), one opened device with
//! its queue, buffers, blocking read-back, the pipelines of the WGSL kernels (built once each, at
//! load for a model, kept in an on-disk cache), the bind groups made once and reused, and the
//! buffers every submission shares, so that a steady state of passes allocates nothing.

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
    /// What is free of that heap now, where the driver reports it (VK_EXT_memory_budget): the
    /// heap's budget for this process less what it uses.
    pub free_bytes: Option<u64>,
    /// The device's compute units where the driver says: NVIDIA's streaming multiprocessors
    /// (VK_NV_shader_sm_builtins), AMD's compute units (VK_AMD_shader_core_properties). A
    /// dispatch of fewer workgroups leaves some of them idle; the profile sets each kernel's
    /// workgroups against this.
    pub compute_units: Option<u32>,
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
        let mib = |b: u64| b / (1 << 20);
        match (self.memory_bytes, self.free_bytes) {
            (Some(total), Some(free)) => {
                write!(f, " ({} MiB, {} MiB free)", mib(total), mib(free))?
            }
            (Some(total), None) => write!(f, " ({} MiB)", mib(total))?,
            _ => {}
        }
        if let Some(n) = self.compute_units {
            write!(f, ", {n} compute units")?;
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
                memory_bytes: device_memory(&a).map(|(_, size)| size),
                free_bytes: device_memory(&a).and_then(|(heap, _)| free_memory(&a, heap)),
                compute_units: compute_units(&a),
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

/// The largest device-local heap of a Vulkan adapter: its index and size.
fn device_memory(a: &wgpu::Adapter) -> Option<(usize, u64)> {
    // SAFETY: as in `has_int8_dot`, the adapter's properties are only read.
    let hal = unsafe { a.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let instance = hal.shared_instance().raw_instance();
    // SAFETY: the physical device belongs to this instance, which outlives the call.
    let props =
        unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
    props
        .memory_heaps_as_slice()
        .iter()
        .enumerate()
        .filter(|(_, h)| h.flags.contains(ash::vk::MemoryHeapFlags::DEVICE_LOCAL))
        .map(|(i, h)| (i, h.size))
        .max_by_key(|&(_, size)| size)
}

/// What is free of heap `heap` of a Vulkan adapter that has VK_EXT_memory_budget: the heap's
/// budget for this process less its usage.
fn free_memory(a: &wgpu::Adapter, heap: usize) -> Option<u64> {
    // SAFETY: as in `has_int8_dot`, the adapter's properties are only read.
    let hal = unsafe { a.as_hal::<wgpu::hal::api::Vulkan>() }?;
    if !hal
        .physical_device_capabilities()
        .supports_extension(c"VK_EXT_memory_budget")
    {
        return None;
    }
    let instance = hal.shared_instance().raw_instance();
    let mut budget = ash::vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
    let mut props = ash::vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
    // SAFETY: the physical device belongs to this instance, which outlives the call; the
    // extension's structure is chained as the specification has it (the device supports it).
    unsafe {
        instance.get_physical_device_memory_properties2(hal.raw_physical_device(), &mut props)
    };
    let (b, used) = (
        *budget.heap_budget.get(heap)?,
        *budget.heap_usage.get(heap)?,
    );
    (b > 0).then(|| b.saturating_sub(used))
}

/// The compute units of a Vulkan adapter whose driver reports them ([`DeviceInfo::compute_units`]).
fn compute_units(a: &wgpu::Adapter) -> Option<u32> {
    // SAFETY: as in `has_int8_dot`, the adapter's properties are only read.
    let hal = unsafe { a.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let caps = hal.physical_device_capabilities();
    let instance = hal.shared_instance().raw_instance();
    let physical = hal.raw_physical_device();
    if caps.supports_extension(c"VK_NV_shader_sm_builtins") {
        let mut sm = ash::vk::PhysicalDeviceShaderSMBuiltinsPropertiesNV::default();
        let mut props = ash::vk::PhysicalDeviceProperties2::default().push_next(&mut sm);
        // SAFETY: the physical device belongs to this instance, which outlives the call; the
        // extension's structure is chained as the specification has it (the device has it).
        unsafe { instance.get_physical_device_properties2(physical, &mut props) };
        return (sm.shader_sm_count > 0).then_some(sm.shader_sm_count);
    }
    if caps.supports_extension(c"VK_AMD_shader_core_properties") {
        let mut core = ash::vk::PhysicalDeviceShaderCorePropertiesAMD::default();
        let mut props = ash::vk::PhysicalDeviceProperties2::default().push_next(&mut core);
        // SAFETY: as above.
        unsafe { instance.get_physical_device_properties2(physical, &mut props) };
        let n = core
            .shader_engine_count
            .checked_mul(core.shader_arrays_per_engine_count)?
            .checked_mul(core.compute_units_per_shader_array)?;
        return (n > 0).then_some(n);
    }
    None
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

/// What the runtime has created and done since the device was opened ([`Gpu::counters`]). A
/// steady state of passes creates no buffers, bind groups or pipelines; its dispatches,
/// submissions and blocking read-backs are what a pass costs the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Device buffers created: weights, caches, scratch, staging.
    pub buffers_created: u64,
    pub bind_groups_created: u64,
    pub pipelines_created: u64,
    pub dispatches: u64,
    /// Command submissions to the queue.
    pub submissions: u64,
    /// Times the host waited for the device (a read-back, a timed pass, an explicit wait).
    pub read_backs: u64,
}

impl Counters {
    /// What happened between `before` and `self`.
    pub fn since(&self, before: &Counters) -> Counters {
        Counters {
            buffers_created: self.buffers_created.saturating_sub(before.buffers_created),
            bind_groups_created: self
                .bind_groups_created
                .saturating_sub(before.bind_groups_created),
            pipelines_created: self
                .pipelines_created
                .saturating_sub(before.pipelines_created),
            dispatches: self.dispatches.saturating_sub(before.dispatches),
            submissions: self.submissions.saturating_sub(before.submissions),
            read_backs: self.read_backs.saturating_sub(before.read_backs),
        }
    }
}

#[derive(Default)]
pub(crate) struct CounterCells {
    pub(crate) buffers: AtomicU64,
    pub(crate) bind_groups: AtomicU64,
    pub(crate) pipelines: AtomicU64,
    pub(crate) dispatches: AtomicU64,
    pub(crate) submissions: AtomicU64,
    pub(crate) read_backs: AtomicU64,
}

impl CounterCells {
    pub(crate) fn add(cell: &AtomicU64, n: u64) {
        cell.fetch_add(n, Ordering::Relaxed);
    }
}

/// The storage bindings of group 0 that one or more kernels share: bindings `1..=n`, each
/// read-only or read-write. Bind groups are made against it and reused by every kernel with the
/// same bindings.
pub(crate) struct StorageLayout {
    pub(crate) id: usize,
    pub(crate) layout: wgpu::BindGroupLayout,
    pub(crate) read_only: Vec<bool>,
}

/// A kernel's pipeline and the layout of its storage bindings.
pub(crate) struct Pipeline {
    pub(crate) compute: wgpu::ComputePipeline,
    pub(crate) storage: Arc<StorageLayout>,
}

/// The most storage buffers one kernel binds.
pub const MAX_BINDINGS: usize = 12;

/// The bytes of the parameter window every dispatch binds (its struct fits in it) and the
/// alignment of a dispatch's parameters in the uniform buffer.
pub(crate) const PARAMS_WINDOW: u64 = 256;

#[derive(Clone, PartialEq, Eq, Hash)]
struct BindKey {
    layout: usize,
    buffers: [Option<wgpu::Buffer>; MAX_BINDINGS],
}

/// Bind groups by (layout, buffers), made once and reused. An entry no submission has used for
/// [`BIND_GROUP_IDLE`] submissions goes, so that the buffers of sequences that ended are not
/// kept alive by it (their owners also destroy them when dropped).
#[derive(Default)]
struct BindCache {
    map: HashMap<BindKey, (wgpu::BindGroup, u64)>,
    epoch: u64,
}

/// Submissions after which an unused bind group is dropped.
const BIND_GROUP_IDLE: u64 = 512;

impl BindCache {
    fn tick(&mut self) {
        self.epoch += 1;
        if self.epoch.is_multiple_of(BIND_GROUP_IDLE / 2) {
            let epoch = self.epoch;
            self.map
                .retain(|_, (_, used)| *used + BIND_GROUP_IDLE >= epoch);
        }
    }
}

/// Buffers every submission uses, kept from one to the next: the parameters of its dispatches
/// (a uniform buffer bound at a dynamic offset per dispatch), the data it uploads (copied from
/// there in order with its other commands), what it reads back (a mappable staging buffer),
/// and the timestamp queries of timed passes. Each grows when a submission needs more and is
/// otherwise reused, so a steady state creates none.
#[derive(Default)]
pub(crate) struct Arena {
    params: Option<(wgpu::Buffer, wgpu::BindGroup)>,
    uploads: Option<wgpu::Buffer>,
    staging: Option<wgpu::Buffer>,
    queries: Option<(wgpu::QuerySet, wgpu::Buffer, u32)>,
}

/// Device memory sizes grow to the next power of two of what is asked, at least `min`.
fn grown(bytes: u64, min: u64) -> u64 {
    bytes.max(min).next_power_of_two()
}

/// An opened device and its queue.
pub struct Gpu {
    pub info: DeviceInfo,
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) limits: wgpu::Limits,
    timestamps: bool,
    dispatch_timestamps: bool,
    pub(crate) counters: CounterCells,
    pipelines: Mutex<HashMap<&'static str, Arc<Pipeline>>>,
    layouts: Mutex<Vec<Arc<StorageLayout>>>,
    params_layout: wgpu::BindGroupLayout,
    bind_groups: Mutex<BindCache>,
    /// Held from writing a submission's parameters and uploads until it is submitted (and read
    /// back), so that two recorders never share the buffers in flight.
    pub(crate) arena: Mutex<Arena>,
    /// Work recorded and not yet submitted ([`crate::Recorder::defer`]): it goes first in the
    /// next submission, and before any read, write or copy of the host's.
    pub(crate) pending: Mutex<crate::pass::Recorded>,
    /// Scratch buffers of the kernels' host functions by name, grown when too small.
    scratch: Mutex<HashMap<&'static str, wgpu::Buffer>>,
    pipeline_cache: Option<(wgpu::PipelineCache, std::path::PathBuf)>,
    errors: Arc<ErrorLog>,
    budget: Arc<MemoryBudget>,
    /// Threads that a weight row of the int8 products spreads over at least, where its blocks
    /// allow ([`Gpu::row_threads`]).
    row_threads: u32,
    /// Invocations every subgroup holds at least, consecutive ones; 1 where the products reduce
    /// through workgroup memory alone ([`Gpu::subgroup_lanes`]).
    lanes: u32,
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
    /// A directory for the driver's compiled pipelines (where the backend keeps a pipeline
    /// cache: Vulkan): read when the device opens, written by [`Gpu::save_pipeline_cache`], so
    /// that a later start compiles nothing. The file is named after the adapter.
    pub pipeline_cache_dir: Option<std::path::PathBuf>,
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

/// Whether a kernel's storage bindings are read-only, in binding order (group 0, bindings
/// `1..=n`), as its WGSL source declares them; its parameters must be the uniform at group 1,
/// binding 0.
pub(crate) fn storage_bindings(kernel: &Kernel) -> Result<Vec<bool>, GpuError> {
    let bad = |why: String| GpuError::Kernel {
        kernel: kernel.name,
        why,
    };
    let src = kernel.source;
    let number = |s: &str, at: usize| -> Option<(u32, usize)> {
        let rest = &s[at..];
        let end = rest.find(')')?;
        Some((rest[..end].trim().parse().ok()?, at + end + 1))
    };
    let mut read_only: Vec<(u32, bool)> = Vec::new();
    let mut uniform = false;
    let mut at = 0;
    while let Some(i) = src[at..].find("@group(") {
        let (group, after) =
            number(src, at + i + 7).ok_or_else(|| bad("an unreadable @group".into()))?;
        let b = src[after..]
            .find("@binding(")
            .ok_or_else(|| bad("@group without @binding".into()))?;
        let (binding, after) =
            number(src, after + b + 9).ok_or_else(|| bad("an unreadable @binding".into()))?;
        let v = src[after..]
            .find("var<")
            .ok_or_else(|| bad(format!("binding {binding} is not a buffer")))?;
        let open = after + v + 4;
        let close = src[open..]
            .find('>')
            .ok_or_else(|| bad(format!("binding {binding}: no '>'")))?;
        let kind: String = src[open..open + close]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        match (group, kind.as_str()) {
            (1, "uniform") if binding == 0 => uniform = true,
            (0, "storage") | (0, "storage,read") => read_only.push((binding, true)),
            (0, "storage,read_write") => read_only.push((binding, false)),
            _ => {
                return Err(bad(format!(
                    "@group({group}) @binding({binding}) var<{kind}>: kernels take their \
                     parameters as the uniform at group 1, binding 0, and storage buffers at \
                     group 0"
                )))
            }
        }
        at = open + close;
    }
    if !uniform {
        return Err(bad("no parameters at @group(1) @binding(0)".into()));
    }
    read_only.sort_by_key(|b| b.0);
    for (i, (binding, _)) in read_only.iter().enumerate() {
        if *binding as usize != i + 1 {
            return Err(bad(format!(
                "storage bindings must be 1, 2, ... in order; binding {binding} is number {}",
                i + 1
            )));
        }
    }
    if read_only.len() > MAX_BINDINGS {
        return Err(bad(format!(
            "{} storage bindings, over {MAX_BINDINGS}",
            read_only.len()
        )));
    }
    Ok(read_only.into_iter().map(|(_, r)| r).collect())
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
        // Subgroup shuffles end the products' reductions; whether the device's subgroups are
        // laid out as they assume is checked once the device is open.
        let subgroups = adapter.features().contains(wgpu::Features::SUBGROUP);
        if subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        let min_lanes = adapter.get_info().subgroup_min_size;
        let cache_file = opts
            .pipeline_cache_dir
            .as_ref()
            .filter(|_| adapter.features().contains(wgpu::Features::PIPELINE_CACHE))
            .and_then(|dir| {
                let key = wgpu::util::pipeline_cache_key(&adapter.get_info())?;
                Some(dir.join(format!("{key}.bin")))
            });
        if cache_file.is_some() {
            features |= wgpu::Features::PIPELINE_CACHE;
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
        let pipeline_cache = cache_file.map(|path| {
            // A missing or unreadable file starts an empty cache.
            let data = std::fs::read(&path).ok();
            // SAFETY: the data is what `PipelineCache::get_data` wrote for an adapter with the
            // same cache key (the file is named after it); wgpu checks its header, and with
            // `fallback` a cache the driver refuses becomes an empty one.
            let cache = unsafe {
                device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                    label: Some("nextn pipelines"),
                    data: data.as_deref(),
                    fallback: true,
                })
            };
            (cache, path)
        });
        let params_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("params"),
            entries: &[wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: std::num::NonZeroU64::new(PARAMS_WINDOW),
                },
                count: None,
            }],
        });
        let row_threads = if info.software {
            1
        } else {
            crate::kernels::matvec::GPU_ROW_THREADS
        };
        let mut gpu = Gpu {
            info,
            device,
            queue,
            limits,
            timestamps,
            dispatch_timestamps,
            counters: CounterCells::default(),
            pipelines: Mutex::new(HashMap::new()),
            layouts: Mutex::new(Vec::new()),
            params_layout,
            bind_groups: Mutex::new(BindCache::default()),
            arena: Mutex::new(Arena::default()),
            pending: Mutex::new(crate::pass::Recorded::default()),
            scratch: Mutex::new(HashMap::new()),
            pipeline_cache,
            errors,
            budget: Arc::new(MemoryBudget {
                limit: opts.memory_budget.or(info_memory),
                used: AtomicU64::new(0),
            }),
            row_threads,
            lanes: 1,
        };
        if subgroups {
            gpu.lanes = gpu.probe_lanes(min_lanes)?;
        }
        Ok(gpu)
    }

    /// The subgroup width the products may count on: the adapter's smallest subgroup size when
    /// one 128-wide workgroup's subgroups turn out to be runs of consecutive invocations of at
    /// least that many (every real driver lays them out so; nothing in the API promises it),
    /// else 1.
    fn probe_lanes(&self, min_lanes: u32) -> Result<u32, GpuError> {
        if !(2..=64).contains(&min_lanes) || !min_lanes.is_power_of_two() {
            return Ok(1);
        }
        let out = self.buffer("subgroup probe", 128 * 2 * 4)?;
        let mut rec = crate::Recorder::new(self);
        rec.dispatch(
            &crate::kernels::SUBGROUP_PROBE,
            &[0],
            &[&out],
            [1, 1, 1],
            128 * 2 * 4,
        )?;
        rec.submit(false)?;
        let words = self.read_u32(&out, 0, 128 * 2)?;
        let laid_out = words.chunks_exact(2).enumerate().all(|(i, w)| {
            let (size, lane) = (w[0], w[1]);
            size >= min_lanes && size.is_power_of_two() && lane == i as u32 % size
        });
        Ok(if laid_out { min_lanes } else { 1 })
    }

    /// Invocations that every subgroup of a product's workgroup holds at least, consecutive ones:
    /// the last steps of its reductions, between threads closer than that, are subgroup shuffles
    /// instead of workgroup memory and barriers, adding the same pairs in the same order (the
    /// same bits). 1 where the device has no subgroup operations, they are turned off
    /// ([`Gpu::disable_subgroups`]) or its subgroups are laid out otherwise.
    pub fn subgroup_lanes(&self) -> u32 {
        self.lanes
    }

    /// Reduce through workgroup memory alone in the pipelines built from now on
    /// (`NEXTN_GPU_SUBGROUPS=0`, for comparisons: the results are the same bits).
    pub fn disable_subgroups(&mut self) {
        self.lanes = 1;
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

    /// Threads that a weight row of the int8-activation products spreads over at least, sharing
    /// its 256-value blocks among them where the row has fewer blocks: on a GPU
    /// [`GPU_ROW_THREADS`](crate::kernels::matvec::GPU_ROW_THREADS), so that even a 1024-wide
    /// matrix of a thousand rows launches hundreds of workgroups and each thread reads a few
    /// dozen bytes; on a device the CPU implements (lavapipe) one, a block a thread, as its
    /// threads are a CPU's vector lanes. Part of how a row's sum is formed: fixed while the
    /// device is open.
    pub fn row_threads(&self) -> u32 {
        self.row_threads
    }

    /// Set [`Gpu::row_threads`] (`NEXTN_GPU_ROW_THREADS`; tests run the GPU setting on lavapipe):
    /// a power of two from 1 to 128.
    pub fn set_row_threads(&mut self, threads: u32) -> Result<(), GpuError> {
        if !threads.is_power_of_two() || threads > 128 {
            return Err(GpuError::Device(format!(
                "{threads} threads a weight row: the products take a power of two from 1 to 128"
            )));
        }
        self.row_threads = threads;
        Ok(())
    }

    /// The largest buffer one kernel binding may see, in bytes.
    pub fn max_binding_bytes(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size
    }

    /// The most workgroups one dispatch may have along x.
    pub fn max_groups_x(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
    }

    /// What the runtime has created and done so far.
    pub fn counters(&self) -> Counters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            buffers_created: get(&c.buffers),
            bind_groups_created: get(&c.bind_groups),
            pipelines_created: get(&c.pipelines),
            dispatches: get(&c.dispatches),
            submissions: get(&c.submissions),
            read_backs: get(&c.read_backs),
        }
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
        self.raw_buffer(
            label,
            bytes.max(4).div_ceil(4) * 4,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
        )
    }

    /// A buffer of `size` bytes with `usage`, with the checks of [`Gpu::buffer`], counted.
    pub(crate) fn raw_buffer(
        &self,
        label: &str,
        size: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer, GpuError> {
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
            usage,
            mapped_at_creation: false,
        });
        CounterCells::add(&self.counters.buffers, 1);
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

    /// The scratch buffer `name` of at least `bytes`, kept from call to call (grown to the next
    /// power of two when too small). Work recorded one after another may share it: each use
    /// sees what the one before it left, as with any buffer.
    pub fn scratch(&self, name: &'static str, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        let mut map = self
            .scratch
            .lock()
            .map_err(|_| GpuError::Device("scratch buffers poisoned".into()))?;
        if let Some(b) = map.get(name).filter(|b| b.size() >= bytes) {
            return Ok(b.clone());
        }
        let b = self.buffer(name, grown(bytes, 256))?;
        map.insert(name, b.clone());
        Ok(b)
    }

    /// A storage buffer holding `data` (padded with zeros to a multiple of 4 bytes).
    pub fn upload(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer, GpuError> {
        let buf = self.buffer(label, data.len() as u64)?;
        self.write(&buf, 0, data)?;
        Ok(buf)
    }

    /// Write `data` at byte `offset` of `buf`, after every command recorded or submitted before
    /// (work deferred by [`crate::Recorder::defer`] is submitted first).
    pub fn write(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<(), GpuError> {
        if data.is_empty() {
            return Ok(());
        }
        self.flush()?;
        if data.len().is_multiple_of(4) {
            self.queue.write_buffer(buf, offset, data);
        } else {
            let mut padded = data.to_vec();
            padded.resize(data.len().div_ceil(4) * 4, 0);
            self.queue.write_buffer(buf, offset, &padded);
        }
        Ok(())
    }

    pub fn write_f32(
        &self,
        buf: &wgpu::Buffer,
        offset_elems: u64,
        data: &[f32],
    ) -> Result<(), GpuError> {
        self.write(buf, offset_elems * 4, bytemuck::cast_slice(data))
    }

    pub fn write_u32(
        &self,
        buf: &wgpu::Buffer,
        offset_elems: u64,
        data: &[u32],
    ) -> Result<(), GpuError> {
        self.write(buf, offset_elems * 4, bytemuck::cast_slice(data))
    }

    /// Copy `bytes` from `src` at `src_offset` to `dst` at `dst_offset` on the device, after
    /// everything recorded before.
    pub fn copy(
        &self,
        src: &wgpu::Buffer,
        src_offset: u64,
        dst: &wgpu::Buffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        let mut rec = crate::Recorder::new(self);
        rec.copy(src, src_offset, dst, dst_offset, bytes);
        rec.submit(false)?;
        Ok(())
    }

    /// Submit the work deferred so far, if any.
    pub fn flush(&self) -> Result<(), GpuError> {
        let empty = self.pending.lock().map(|p| p.is_empty()).unwrap_or(true);
        if empty {
            return Ok(());
        }
        crate::Recorder::new(self).submit(false)?;
        Ok(())
    }

    /// Read `bytes` of `buf` from byte `offset` (both multiples of 4), after everything recorded
    /// before.
    pub fn read(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>, GpuError> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let mut rec = crate::Recorder::new(self);
        let slot = rec.read_back(buf, offset, bytes);
        let mut back = rec.submit_read(crate::Timing::Off)?;
        Ok(back.take(slot))
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
        self.flush()?;
        CounterCells::add(&self.counters.read_backs, 1);
        self.poll_wait()
    }

    pub(crate) fn poll_wait(&self) -> Result<(), GpuError> {
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

    /// The layout of storage bindings `read_only`, made once.
    fn storage_layout(&self, read_only: &[bool]) -> Result<Arc<StorageLayout>, GpuError> {
        let mut layouts = self
            .layouts
            .lock()
            .map_err(|_| GpuError::Device("layout cache poisoned".into()))?;
        if let Some(l) = layouts.iter().find(|l| l.read_only == read_only) {
            return Ok(l.clone());
        }
        let entries: Vec<wgpu::BindGroupLayoutEntry> = read_only
            .iter()
            .enumerate()
            .map(|(i, &read_only)| wgpu::BindGroupLayoutEntry {
                binding: i as u32 + 1,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("storage"),
                entries: &entries,
            });
        let l = Arc::new(StorageLayout {
            id: layouts.len(),
            layout,
            read_only: read_only.to_vec(),
        });
        layouts.push(l.clone());
        Ok(l)
    }

    /// Build `kernel`'s pipeline (not cached here).
    fn build_pipeline(&self, kernel: &Kernel) -> Result<Pipeline, GpuError> {
        let storage = self.storage_layout(&storage_bindings(kernel)?)?;
        let layout = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(kernel.name),
                bind_group_layouts: &[Some(&storage.layout), Some(&self.params_layout)],
                immediate_size: 0,
            });
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(kernel.name),
                source: wgpu::ShaderSource::Wgsl(kernel.source_for(self.lanes)),
            });
        let compute = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(kernel.name),
                layout: Some(&layout),
                module: &module,
                entry_point: Some(kernel.entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &[],
                    zero_initialize_workgroup_memory: false,
                },
                cache: self.pipeline_cache.as_ref().map(|(c, _)| c),
            });
        CounterCells::add(&self.counters.pipelines, 1);
        if let Some(e) = pollster::block_on(validation.pop()) {
            return Err(GpuError::Kernel {
                kernel: kernel.name,
                why: e.to_string(),
            });
        }
        Ok(Pipeline { compute, storage })
    }

    /// Make the bind group a later dispatch of `kernel` over `buffers` will use, so that making
    /// it is not on that dispatch's path (a sequence's first commit replay, say).
    pub fn bind_ahead(
        &self,
        kernel: &'static Kernel,
        buffers: &[&wgpu::Buffer],
    ) -> Result<(), GpuError> {
        let pipeline = self.pipeline(kernel)?;
        self.bind_group(kernel.name, &pipeline.storage, buffers)
            .map(|_| ())
    }

    /// The pipeline of `kernel`, built on first use (a model builds all of its own at load,
    /// [`Gpu::prepare`]).
    pub(crate) fn pipeline(&self, kernel: &'static Kernel) -> Result<Arc<Pipeline>, GpuError> {
        if let Some(p) = self
            .pipelines
            .lock()
            .map_err(|_| GpuError::Device("pipeline cache poisoned".into()))?
            .get(kernel.name)
        {
            return Ok(p.clone());
        }
        let p = Arc::new(self.build_pipeline(kernel)?);
        let mut cache = self
            .pipelines
            .lock()
            .map_err(|_| GpuError::Device("pipeline cache poisoned".into()))?;
        Ok(cache.entry(kernel.name).or_insert(p).clone())
    }

    /// Build the pipelines of `kernels` that are not built yet, several at a time, and keep the
    /// driver's compiled code in the pipeline cache file when there is one. Returns how many
    /// were built.
    pub fn prepare(&self, kernels: &[&'static Kernel]) -> Result<usize, GpuError> {
        let mut todo: Vec<&'static Kernel> = {
            let have = self
                .pipelines
                .lock()
                .map_err(|_| GpuError::Device("pipeline cache poisoned".into()))?;
            kernels
                .iter()
                .copied()
                .filter(|k| !have.contains_key(k.name))
                .collect()
        };
        todo.sort_by_key(|k| k.name);
        todo.dedup_by_key(|k| k.name);
        if todo.is_empty() {
            return Ok(0);
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 8)
            .min(todo.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        let failed: Mutex<Option<GpuError>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(k) = todo.get(i) else { break };
                    if let Err(e) = self.pipeline(k) {
                        if let Ok(mut f) = failed.lock() {
                            f.get_or_insert(e);
                        }
                        break;
                    }
                });
            }
        });
        if let Some(e) = failed.lock().ok().and_then(|mut f| f.take()) {
            return Err(e);
        }
        self.save_pipeline_cache();
        Ok(todo.len())
    }

    /// Write the pipeline cache file (when there is one): what the driver compiled so far. A
    /// failure to write it costs only compile time at the next start, so it is not an error.
    pub fn save_pipeline_cache(&self) {
        let Some((cache, path)) = &self.pipeline_cache else {
            return;
        };
        let Some(data) = cache.get_data() else {
            return;
        };
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, &data)?;
            std::fs::rename(&tmp, path)
        };
        if let Err(e) = write() {
            log::warn!("pipeline cache {} not written: {e}", path.display());
        }
    }

    /// The bind group of `buffers` for `layout`, made on first use.
    pub(crate) fn bind_group(
        &self,
        kernel: &'static str,
        layout: &StorageLayout,
        buffers: &[&wgpu::Buffer],
    ) -> Result<wgpu::BindGroup, GpuError> {
        if buffers.len() != layout.read_only.len() {
            return Err(GpuError::Kernel {
                kernel,
                why: format!(
                    "{} buffers given for {} storage bindings",
                    buffers.len(),
                    layout.read_only.len()
                ),
            });
        }
        let mut key = BindKey {
            layout: layout.id,
            buffers: Default::default(),
        };
        for (slot, b) in key.buffers.iter_mut().zip(buffers) {
            *slot = Some((*b).clone());
        }
        let mut cache = self
            .bind_groups
            .lock()
            .map_err(|_| GpuError::Device("bind group cache poisoned".into()))?;
        let epoch = cache.epoch;
        if let Some((group, used)) = cache.map.get_mut(&key) {
            *used = epoch;
            return Ok(group.clone());
        }
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            })
            .collect();
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout.layout,
            entries: &entries,
        });
        CounterCells::add(&self.counters.bind_groups, 1);
        cache.map.insert(key, (group.clone(), epoch));
        Ok(group)
    }

    /// One more submission for the bind group cache's idea of time.
    pub(crate) fn tick(&self) {
        if let Ok(mut c) = self.bind_groups.lock() {
            c.tick();
        }
    }
}

impl Arena {
    /// The parameters buffer and its bind group, holding at least `bytes`, and `data` written
    /// at its start (ordered before the next submission).
    pub(crate) fn params(&mut self, gpu: &Gpu, data: &[u8]) -> Result<wgpu::BindGroup, GpuError> {
        let need = data.len() as u64 + PARAMS_WINDOW;
        if self.params.as_ref().is_none_or(|(b, _)| b.size() < need) {
            let size = grown(need, 64 << 10);
            let buffer = gpu.raw_buffer(
                "params",
                size,
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            )?;
            let group = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("params"),
                layout: &gpu.params_layout,
                entries: &[wgpu::BindGroupEntry {
                    binding: 0,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &buffer,
                        offset: 0,
                        size: std::num::NonZeroU64::new(PARAMS_WINDOW),
                    }),
                }],
            });
            CounterCells::add(&gpu.counters.bind_groups, 1);
            self.params = Some((buffer, group));
        }
        let Some((buffer, group)) = &self.params else {
            return Err(GpuError::Device("no parameter buffer".into()));
        };
        if !data.is_empty() {
            gpu.queue.write_buffer(buffer, 0, data);
        }
        Ok(group.clone())
    }

    /// The upload buffer holding `data` at its start (ordered before the next submission).
    pub(crate) fn uploads(&mut self, gpu: &Gpu, data: &[u8]) -> Result<wgpu::Buffer, GpuError> {
        let need = data.len() as u64;
        if self.uploads.as_ref().is_none_or(|b| b.size() < need) {
            self.uploads = Some(gpu.raw_buffer(
                "uploads",
                grown(need, 64 << 10),
                wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            )?);
        }
        let Some(buffer) = &self.uploads else {
            return Err(GpuError::Device("no upload buffer".into()));
        };
        gpu.queue.write_buffer(buffer, 0, data);
        Ok(buffer.clone())
    }

    /// The mappable staging buffer, at least `bytes` long.
    pub(crate) fn staging(&mut self, gpu: &Gpu, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        if self.staging.as_ref().is_none_or(|b| b.size() < bytes) {
            self.staging = Some(gpu.raw_buffer(
                "read-back",
                grown(bytes, 64 << 10),
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )?);
        }
        self.staging
            .clone()
            .ok_or_else(|| GpuError::Device("no staging buffer".into()))
    }

    /// A timestamp query set of at least `count` queries and the buffer it resolves into.
    pub(crate) fn queries(
        &mut self,
        gpu: &Gpu,
        count: u32,
    ) -> Result<(wgpu::QuerySet, wgpu::Buffer), GpuError> {
        if self.queries.as_ref().is_none_or(|q| q.2 < count) {
            let n = (count as u64).next_power_of_two().max(64) as u32;
            let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("pass-time"),
                ty: wgpu::QueryType::Timestamp,
                count: n,
            });
            let resolve = gpu.raw_buffer(
                "pass-time-resolve",
                n as u64 * 8,
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            )?;
            self.queries = Some((set, resolve, n));
        }
        let Some((set, resolve, _)) = &self.queries else {
            return Err(GpuError::Device("no query set".into()));
        };
        Ok((set.clone(), resolve.clone()))
    }
}
