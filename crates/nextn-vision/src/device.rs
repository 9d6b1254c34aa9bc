//! The tower on the device: the patch embedding, every block and the mergers run as kernels
//! (nextn-gpu's products and its vision kernels); the host cuts the picture into patch rows and
//! resizes the position table to the grid, both cheap and both read straight from the picture.
//!
//! Buffers are sized once, at [`DeviceTower::new`], for the largest image the tower's token
//! bounds allow, so an encode allocates nothing on the device. The tower keeps to buffers of its
//! own (its products take the f32 path, which needs no shared scratch): its encodes run beside
//! the model's passes from another thread without touching anything they use. One block is one
//! submission and one wait, so a cancelled encode stops within a block's time.

use std::sync::{Arc, Mutex};

use nextn_gpu::kernels::matvec::{product, Acts, Epilogue};
use nextn_gpu::kernels::vision::{
    attention_full, bias_act, layer_norm, rope_vision, BiasThen, QkvRows, MAX_HEAD_DIM,
};
use nextn_gpu::{DeviceMatrix, Gpu, GpuError, Recorder, Reservation};

use crate::block::{Block, Merger, ROPE_BASE};
use crate::error::VisionError;
use crate::patch::{patch_rows, Grid};
use crate::preprocess::PreparedImage;
use crate::tower::{ImageEmbedding, VisionTower};
use crate::weights::{Linear, Norm};

fn device_err(what: impl Into<String>) -> impl FnOnce(GpuError) -> VisionError {
    let what = what.into();
    move |source| VisionError::Device { what, source }
}

/// A weight matrix and its bias on the device.
struct DeviceLinear {
    m: DeviceMatrix,
    bias: Option<wgpu::Buffer>,
}

impl DeviceLinear {
    fn upload(gpu: &Gpu, l: &Linear) -> Result<DeviceLinear, VisionError> {
        let up = device_err(format!("uploading {}", l.name()));
        let mut m = DeviceMatrix::upload(gpu, l.name(), l.ty(), l.rows(), l.cols(), l.bytes())
            .map_err(up)?;
        // The f32 path: its products use no scratch buffer that the model's passes share.
        m.set_int8(false)
            .map_err(device_err(format!("uploading {}", l.name())))?;
        let bias = match l.bias() {
            Some(b) => Some(
                gpu.upload(l.name(), bytemuck::cast_slice(b))
                    .map_err(device_err(format!("uploading the bias of {}", l.name())))?,
            ),
            None => None,
        };
        Ok(DeviceLinear { m, bias })
    }
}

struct DeviceNorm {
    w: wgpu::Buffer,
    b: wgpu::Buffer,
}

impl DeviceNorm {
    fn upload(gpu: &Gpu, n: &Norm, what: &str) -> Result<DeviceNorm, VisionError> {
        let up = |v: &[f32]| {
            gpu.upload(what, bytemuck::cast_slice(v))
                .map_err(device_err(format!("uploading {what}")))
        };
        Ok(DeviceNorm {
            w: up(&n.weight)?,
            b: up(&n.bias)?,
        })
    }
}

struct DeviceBlock {
    ln1: DeviceNorm,
    qkv: DeviceLinear,
    out: DeviceLinear,
    ln2: DeviceNorm,
    up: DeviceLinear,
    down: DeviceLinear,
    deepstack: Option<DeviceMerger>,
}

struct DeviceMerger {
    norm: Option<DeviceNorm>,
    fc1: DeviceLinear,
    fc2: DeviceLinear,
}

impl DeviceMerger {
    fn upload(gpu: &Gpu, m: &Merger, what: &str) -> Result<DeviceMerger, VisionError> {
        Ok(DeviceMerger {
            norm: match &m.norm {
                Some(n) => Some(DeviceNorm::upload(gpu, n, &format!("{what} norm"))?),
                None => None,
            },
            fc1: DeviceLinear::upload(gpu, &m.fc1)?,
            fc2: DeviceLinear::upload(gpu, &m.fc2)?,
        })
    }
}

/// The activations of one encode, each sized for the most patches an image may have.
struct Buffers {
    /// Patch rows (`3 p²` normalised values each).
    patches: wgpu::Buffer,
    /// The position embeddings of the grid's patches.
    pos: wgpu::Buffer,
    x: wgpu::Buffer,
    cur: wgpu::Buffer,
    qkv: wgpu::Buffer,
    attn: wgpu::Buffer,
    up: wgpu::Buffer,
    /// A merger's normed groups of 2x2 patches, then its hidden rows.
    merged: wgpu::Buffer,
    hidden: wgpu::Buffer,
    /// The embeddings: main path and deepstack paths side by side.
    out: wgpu::Buffer,
}

/// The tower's weights and activations on one device.
pub(crate) struct DeviceTower {
    gpu: Arc<Gpu>,
    patch: [DeviceMatrix; 2],
    patch_bias: wgpu::Buffer,
    pre_ln: Option<DeviceNorm>,
    blocks: Vec<DeviceBlock>,
    post_ln: Option<DeviceNorm>,
    merger: DeviceMerger,
    /// Held for the length of an encode: one image at a time uses the buffers.
    buffers: Mutex<Buffers>,
    max_patches: usize,
    bytes: u64,
    _reservation: Reservation,
}

/// Patches a tower's largest image has: its most output tokens, each a square of merged patches.
pub(crate) fn max_patches(tower: &VisionTower) -> usize {
    let cfg = tower.config();
    cfg.max_tokens as usize * cfg.n_merge * cfg.n_merge
}

impl DeviceTower {
    pub(crate) fn new(gpu: Arc<Gpu>, t: &VisionTower) -> Result<DeviceTower, VisionError> {
        let cfg = t.config();
        if cfg.d_head as u32 > MAX_HEAD_DIM || cfg.n_merge != 2 {
            return Err(VisionError::Device {
                what: format!(
                    "heads of {} values, {}x{} merged patches",
                    cfg.d_head, cfg.n_merge, cfg.n_merge
                ),
                source: GpuError::BadTensor {
                    tensor: "v.blk.0.attn_qkv".into(),
                    why: format!(
                        "the device takes heads of at most {MAX_HEAD_DIM} values and 2x2 merges"
                    ),
                },
            });
        }
        let e = cfg.n_embd;
        let n = max_patches(t);
        let width = t.embedding_width();
        let cols = t.patch.frame0.cols();
        // The activation buffers for images of up to `tokens` tokens (4 patches each).
        let sizes_for = |tokens: usize| {
            let f32s = |count: usize| (count as u64 * 4).next_multiple_of(16);
            let n = 4 * tokens;
            [
                f32s(n * cols),
                f32s(n * e),
                f32s(n * e),
                f32s(n * e),
                f32s(n * 3 * e),
                f32s(n * e),
                f32s(n * cfg.n_ff),
                f32s(n * e),
                f32s(n * e),
                f32s(tokens * width),
            ]
        };
        let largest = |tokens: usize| sizes_for(tokens).into_iter().max().unwrap_or(0);
        let sizes = sizes_for(n / 4);
        // Every buffer is bound whole: the largest must be within the device's binding limit.
        let limit = gpu.max_binding_bytes();
        if largest(n / 4) > limit {
            let fits = (0..n / 4)
                .rev()
                .find(|&tokens| largest(tokens) <= limit)
                .unwrap_or(0);
            return Err(VisionError::DeviceBinding {
                tokens: cfg.max_tokens,
                bytes: largest(n / 4),
                limit,
                fits: fits as u64,
            });
        }
        // The activations, and the norms and biases (the matrices reserve their own bytes).
        let total: u64 = sizes.iter().sum::<u64>() + vector_bytes(t);
        let reservation = gpu
            .reserve("the vision tower's activations, norms and biases", total)
            .map_err(device_err("reserving its activations"))?;
        let buf = |label: &str, bytes: u64| {
            gpu.buffer(label, bytes)
                .map_err(device_err(format!("allocating {label}")))
        };
        let buffers = Buffers {
            patches: buf("vision patches", sizes[0])?,
            pos: buf("vision positions", sizes[1])?,
            x: buf("vision x", sizes[2])?,
            cur: buf("vision normed", sizes[3])?,
            qkv: buf("vision qkv", sizes[4])?,
            attn: buf("vision attention", sizes[5])?,
            up: buf("vision mlp", sizes[6])?,
            merged: buf("vision merged", sizes[7])?,
            hidden: buf("vision merger hidden", sizes[8])?,
            out: buf("vision embeddings", sizes[9])?,
        };
        let frame0 = DeviceLinear::upload(&gpu, &t.patch.frame0)?.m;
        let frame1 = DeviceLinear::upload(&gpu, &t.patch.frame1)?.m;
        let patch_bias = gpu
            .upload("v.patch_embd.bias", bytemuck::cast_slice(&t.patch.bias))
            .map_err(device_err("uploading v.patch_embd.bias"))?;
        let norm = |n: &Option<Norm>, what: &str| -> Result<Option<DeviceNorm>, VisionError> {
            n.as_ref()
                .map(|n| DeviceNorm::upload(&gpu, n, what))
                .transpose()
        };
        let pre_ln = norm(&t.pre_ln, "v.pre_ln")?;
        let post_ln = norm(&t.post_ln, "v.post_ln")?;
        let mut blocks = Vec::with_capacity(t.blocks.len());
        for (il, b) in t.blocks.iter().enumerate() {
            blocks.push(upload_block(&gpu, b, il)?);
        }
        let merger = DeviceMerger::upload(&gpu, &t.merger, "mm")?;
        let mut kernels = Vec::new();
        for m in [&frame0, &frame1] {
            kernels.extend(m.kernels());
        }
        let mut bytes = total + frame0.device_bytes() + frame1.device_bytes();
        let mut linears: Vec<&DeviceLinear> = vec![&merger.fc1, &merger.fc2];
        for b in &blocks {
            linears.extend([&b.qkv, &b.out, &b.up, &b.down]);
            if let Some(ds) = &b.deepstack {
                linears.extend([&ds.fc1, &ds.fc2]);
            }
        }
        for l in &linears {
            kernels.extend(l.m.kernels());
            bytes += l.m.device_bytes();
        }
        kernels.extend(nextn_gpu::kernels::vision::KERNELS);
        gpu.prepare(&kernels)
            .map_err(device_err("building its kernels"))?;
        Ok(DeviceTower {
            gpu,
            patch: [frame0, frame1],
            patch_bias,
            pre_ln,
            blocks,
            post_ln,
            merger,
            buffers: Mutex::new(buffers),
            max_patches: n,
            bytes,
            _reservation: reservation,
        })
    }

    /// Device memory the tower holds: weights and activations.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The encoder forward of one prepared image on the device; `stop_if_cancelled` is asked
    /// before the patch embedding and after each block (the last time before the merger), as on
    /// the CPU.
    pub(crate) fn encode(
        &self,
        t: &VisionTower,
        img: &PreparedImage,
        stop_if_cancelled: &dyn Fn() -> Result<(), VisionError>,
    ) -> Result<ImageEmbedding, VisionError> {
        stop_if_cancelled()?;
        let cfg = t.config();
        let (nx, ny) = t.token_grid(img);
        let grid = Grid {
            nx: 2 * nx,
            ny: 2 * ny,
        };
        let n = grid.n();
        if n > self.max_patches {
            return Err(VisionError::DeviceCapacity {
                patches: n,
                capacity: self.max_patches,
            });
        }
        let b = self.buffers.lock().map_err(|_| VisionError::Device {
            what: "its buffers".into(),
            source: GpuError::Device("poisoned by a failed encode".into()),
        })?;
        let e = cfg.n_embd as u32;
        let n32 = n as u32;
        let gpu = &*self.gpu;

        // The patch embedding: both temporal kernels over the same patch rows (rounded to the
        // kernels' type as im2col rounds them), the bias, then the position embeddings.
        let cols = t.patch.frame0.cols();
        let mut rows = patch_rows(img, grid, t.patch.patch, cfg);
        crate::gemm::round_in_place(t.patch.frame0.ty(), &mut rows);
        let mut pos = vec![0f32; n * cfg.n_embd];
        t.pos.add_to(&mut pos, grid);
        let mut rec = Recorder::new(gpu);
        rec.upload(&b.patches, 0, bytemuck::cast_slice(&rows));
        rec.upload(&b.pos, 0, bytemuck::cast_slice(&pos));
        let acts = Acts::f32(&b.patches, 0, cols as u32);
        let add = Epilogue {
            add: true,
            scale: 1.0,
        };
        let patch_embed = |rec: &mut Recorder| -> Result<(), GpuError> {
            product(
                rec,
                &self.patch[0],
                &acts,
                n32,
                &b.x,
                0,
                e,
                Epilogue::default(),
            )?;
            product(rec, &self.patch[1], &acts, n32, &b.x, 0, e, add)
        };
        patch_embed(&mut rec).map_err(device_err("the patch embedding"))?;
        let then = BiasThen {
            add: Some((&b.pos, 0, e)),
            gelu: false,
        };
        bias_act(&mut rec, &b.x, 0, e, n32, e, &self.patch_bias, then)
            .map_err(device_err("the position embeddings"))?;
        if let Some(norm) = &self.pre_ln {
            norm_rows(&mut rec, &b, norm, n32, e, cfg.eps).map_err(device_err("v.pre_ln"))?;
            rec.copy(&b.cur, 0, &b.x, 0, n as u64 * e as u64 * 4);
        }
        self.submit(rec, "the patch embedding")?;

        let width = t.embedding_width() as u32;
        let proj = cfg.projection_dim as u32;
        let mut deepstack = 0u32;
        for (il, block) in self.blocks.iter().enumerate() {
            let mut rec = Recorder::new(gpu);
            self.record_block(&mut rec, &b, block, cfg, grid)
                .map_err(device_err(format!("block {il}")))?;
            if let Some(ds) = &block.deepstack {
                deepstack += 1;
                record_merger(
                    &mut rec,
                    &b,
                    ds,
                    &b.x,
                    n32 / 4,
                    e,
                    cfg.eps,
                    deepstack * proj,
                    width,
                )
                .map_err(device_err(format!("deepstack merger {il}")))?;
            }
            self.submit(rec, &format!("block {il}"))?;
            stop_if_cancelled()?;
        }
        let mut rec = Recorder::new(gpu);
        let input = match &self.post_ln {
            Some(norm) => {
                norm_rows(&mut rec, &b, norm, n32, e, cfg.eps).map_err(device_err("v.post_ln"))?;
                &b.cur
            }
            None => &b.x,
        };
        record_merger(
            &mut rec,
            &b,
            &self.merger,
            input,
            n32 / 4,
            e,
            cfg.eps,
            0,
            width,
        )
        .map_err(device_err("the merger"))?;
        let tokens = n / 4;
        let slot = rec.read_back(&b.out, 0, (tokens * width as usize * 4) as u64);
        let mut back = rec
            .submit_read(nextn_gpu::Timing::Off)
            .map_err(device_err("the merger"))?;
        self.gpu.check().map_err(device_err("the merger"))?;
        let data = back.f32s(slot);
        if data.len() != tokens * width as usize {
            return Err(VisionError::Device {
                what: "reading the embeddings back".into(),
                source: GpuError::ReadBack(format!(
                    "{} values, {} expected",
                    data.len(),
                    tokens * width as usize
                )),
            });
        }
        Ok(ImageEmbedding {
            nx,
            ny,
            width: width as usize,
            data,
        })
    }

    /// Submit and wait, so that the next cancellation check comes after this work; what the
    /// device reported about it is this encode's error, not a later pass's.
    fn submit(&self, rec: Recorder, what: &str) -> Result<(), VisionError> {
        rec.submit(false).map_err(device_err(what))?;
        self.gpu.wait().map_err(device_err(what))?;
        self.gpu.check().map_err(device_err(what))
    }

    /// One ViT block over the rows in `b.x`, in place.
    fn record_block(
        &self,
        rec: &mut Recorder,
        b: &Buffers,
        block: &DeviceBlock,
        cfg: &crate::VisionConfig,
        grid: Grid,
    ) -> Result<(), GpuError> {
        let n = grid.n() as u32;
        let e = cfg.n_embd as u32;
        let (ff, eps) = (cfg.n_ff as u32, cfg.eps);
        let add = Epilogue {
            add: true,
            scale: 1.0,
        };
        norm_rows(rec, b, &block.ln1, n, e, eps)?;
        linear(
            rec,
            &block.qkv,
            &b.cur,
            e,
            n,
            (&b.qkv, 0, 3 * e),
            Epilogue::default(),
            false,
        )?;
        let qkv = QkvRows {
            buf: &b.qkv,
            off: 0,
            stride: 3 * e,
            rows: n,
            n_head: cfg.n_head as u32,
            d: cfg.d_head as u32,
            k_off: e,
            v_off: 2 * e,
        };
        let half = cfg.d_head / 2;
        rope_vision(
            rec,
            &qkv,
            grid.nx as u32,
            ROPE_BASE.powf(-2.0 / half as f32),
        )?;
        let scale = 1.0 / (cfg.d_head as f32).sqrt();
        attention_full(rec, &qkv, scale, (&b.attn, 0, e))?;
        // The residual is the product's destination: x += W·attn, then the bias.
        linear(rec, &block.out, &b.attn, e, n, (&b.x, 0, e), add, false)?;
        norm_rows(rec, b, &block.ln2, n, e, eps)?;
        linear(
            rec,
            &block.up,
            &b.cur,
            e,
            n,
            (&b.up, 0, ff),
            Epilogue::default(),
            true,
        )?;
        linear(rec, &block.down, &b.up, ff, n, (&b.x, 0, e), add, false)
    }
}

/// Layer norm of the `n` rows of `b.x` (`e` wide) into `b.cur`.
fn norm_rows(
    rec: &mut Recorder,
    b: &Buffers,
    norm: &DeviceNorm,
    n: u32,
    e: u32,
    eps: f32,
) -> Result<(), GpuError> {
    layer_norm(
        rec,
        (&b.x, 0, e),
        n,
        e,
        &norm.w,
        &norm.b,
        (&b.cur, 0, e),
        eps,
    )
}

/// `y = W x + b` for `n` rows of `x` (`cols` values each, contiguous) into `y` (buffer, first
/// element, distance between rows), added to what `y` holds as the epilogue says, with GELU
/// after the bias when `gelu`.
#[allow(clippy::too_many_arguments)]
fn linear(
    rec: &mut Recorder,
    l: &DeviceLinear,
    x: &wgpu::Buffer,
    cols: u32,
    n: u32,
    (y, y_off, y_stride): (&wgpu::Buffer, u32, u32),
    epilogue: Epilogue,
    gelu: bool,
) -> Result<(), GpuError> {
    product(
        rec,
        &l.m,
        &Acts::f32(x, 0, cols),
        n,
        y,
        y_off,
        y_stride,
        epilogue,
    )?;
    if let Some(bias) = &l.bias {
        let rows = l.m.rows() as u32;
        bias_act(
            rec,
            y,
            y_off,
            y_stride,
            n,
            rows,
            bias,
            BiasThen { add: None, gelu },
        )?;
    }
    Ok(())
}

/// A merger over `groups` groups of 2x2 patches (`x`: rows of `e`, four consecutive rows a
/// group): the optional layer norm over each group, `fc2(gelu(fc1(.)))` into `b.out` at column
/// `col` of rows `width` wide.
#[allow(clippy::too_many_arguments)]
fn record_merger(
    rec: &mut Recorder,
    b: &Buffers,
    m: &DeviceMerger,
    x: &wgpu::Buffer,
    groups: u32,
    e: u32,
    eps: f32,
    col: u32,
    width: u32,
) -> Result<(), GpuError> {
    let merged = 4 * e;
    let input = match &m.norm {
        Some(norm) => {
            layer_norm(
                rec,
                (x, 0, merged),
                groups,
                merged,
                &norm.w,
                &norm.b,
                (&b.merged, 0, merged),
                eps,
            )?;
            &b.merged
        }
        None => x,
    };
    let hidden = m.fc1.m.rows() as u32;
    linear(
        rec,
        &m.fc1,
        input,
        merged,
        groups,
        (&b.hidden, 0, hidden),
        Epilogue::default(),
        true,
    )?;
    linear(
        rec,
        &m.fc2,
        &b.hidden,
        hidden,
        groups,
        (&b.out, col, width),
        Epilogue::default(),
        false,
    )
}

/// Bytes of the tower's vectors on the device: norm weights and biases, and the biases of its
/// matrices.
fn vector_bytes(t: &VisionTower) -> u64 {
    let norm = |n: &Norm| (n.weight.len() + n.bias.len()) as u64 * 4;
    let bias = |l: &Linear| l.bias().map_or(0, |b| b.len() as u64 * 4);
    let merger = |m: &Merger| m.norm.as_ref().map_or(0, norm) + bias(&m.fc1) + bias(&m.fc2);
    let blocks: u64 = t
        .blocks
        .iter()
        .map(|b| {
            norm(&b.ln1)
                + norm(&b.ln2)
                + [&b.qkv, &b.out, &b.up, &b.down]
                    .into_iter()
                    .map(bias)
                    .sum::<u64>()
                + b.deepstack.as_ref().map_or(0, merger)
        })
        .sum();
    t.patch.bias.len() as u64 * 4
        + t.pre_ln.as_ref().map_or(0, norm)
        + t.post_ln.as_ref().map_or(0, norm)
        + merger(&t.merger)
        + blocks
}

fn upload_block(gpu: &Gpu, b: &Block, il: usize) -> Result<DeviceBlock, VisionError> {
    let pre = format!("v.blk.{il}");
    Ok(DeviceBlock {
        ln1: DeviceNorm::upload(gpu, &b.ln1, &format!("{pre}.ln1"))?,
        qkv: DeviceLinear::upload(gpu, &b.qkv)?,
        out: DeviceLinear::upload(gpu, &b.out)?,
        ln2: DeviceNorm::upload(gpu, &b.ln2, &format!("{pre}.ln2"))?,
        up: DeviceLinear::upload(gpu, &b.up)?,
        down: DeviceLinear::upload(gpu, &b.down)?,
        deepstack: match &b.deepstack {
            Some(m) => Some(DeviceMerger::upload(gpu, m, &format!("v.deepstack.{il}"))?),
            None => None,
        },
    })
}
