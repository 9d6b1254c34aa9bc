//! Weight matrix times activation rows: `y[i][r] = sum_c W[r][c] * x[i][c]`, for a
//! [`DeviceMatrix`] or for the experts of a [`DeviceExperts`] that a MoE router picked.
//!
//! One WGSL module per weight type and per count N of activation rows that a workgroup
//! multiplies by the weight blocks it has read once: N = 1..=8 for decode and speculative verify
//! (1 + k rows), and a tile of [`TILE_ROWS`] rows for prefill (longer batches go in tiles, the
//! rest in groups of 8 and one smaller group). Each module is a shared skeleton with the type's
//! unit decoder appended. A row's result is the same bits for every N, tile or group: the
//! threads sharing a weight row, the units each takes and the tree that adds their partial sums
//! depend only on the matrix's type and width.
//!
//! Two paths, fixed per matrix at upload ([`DeviceMatrix::int8`]):
//! - f32 activations (`matvec.wgsl`): weights decoded to f32 and multiplied by the f32 rows;
//! - int8 activations (`matvec_i8.wgsl`), for Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and IQ4_XS on
//!   adapters with packed 4 x 8-bit integer dot products ([`crate::DeviceInfo::int8_dot`]):
//!   each row is first quantized on the device as nextn-quant's CPU path quantizes it for the
//!   type (Q8_0 blocks of 32 for Q8_0 and Q4_0, Q8_K blocks of 256 for the others), then the
//!   part of a block a thread takes (the block, or a run of its 32-value sub-blocks where a
//!   narrow row shares its blocks among threads, [`split_log2`]) is an exact integer sum
//!   (`dot4I8Packed`) scaled once in f32, as the CPU forms a block's.

use super::Kernel;
use crate::weights::{DeviceExperts, DeviceMatrix, Packed};
use crate::{GpuError, Recorder};

/// Threads per workgroup (`WG` in matvec.wgsl and matvec_i8.wgsl).
const WG: u32 = 128;

/// Activation rows a mat-vec workgroup takes at most (decode, verify).
pub const MAX_BATCH: u32 = 8;

/// Activation rows a prefill tile takes: batches of more rows than this go in tiles first.
pub const TILE_ROWS: u32 = 32;

/// Weight rows each thread carries, by N - 1 (`R` in the module of N). One: a GPU keeps the few
/// activation rows in its first-level cache, so more rows a thread would only cut the
/// workgroups a dispatch launches (a 1024-row matrix must still fill a card of 132 compute
/// units).
const ROWS_PER_THREAD: [u32; 8] = [1; 8];

/// The same for a gate|up pair, of each of its two matrices.
const PAIR_ROWS_PER_THREAD: [u32; 8] = [1; 8];

/// Threads that a weight row's units spread over on a GPU (a subgroup on most), where the row
/// has enough of them: the int8 path shares a block among threads to reach it ([`split_log2`],
/// [`crate::Gpu::row_threads`]).
pub const GPU_ROW_THREADS: u32 = 32;

/// Weight rows per thread in a tile, and the outputs it reduces per round (its workgroup
/// memory is `WG * TILE_RED` floats, as large as the 8-row gate|up module's).
const TILE_R: u32 = 1;
const TILE_RED: u32 = 16;
const _: () = assert!((TILE_ROWS * TILE_R).is_multiple_of(TILE_RED));

/// The kernels of one weight type on one path: `matvec` for N = 1..=8 and for a tile,
/// `matvec_experts` (the N = 1 module with the expert-indexed entry point), and the same
/// modules over a gate|up pair with SwiGLU in their epilogue.
pub struct Family {
    pub rows: [Kernel; 8],
    pub tile: Kernel,
    pub experts: Kernel,
    pub pair_rows: [Kernel; 8],
    pub pair_tile: Kernel,
    /// Rows of the matrix dequantized, as an embedding table (f32-activation families: every
    /// type has one).
    pub embed: Option<Kernel>,
}

/// How a type's int8 path quantizes the activations (`kind` in quantize_q8.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActBlocks {
    /// 32 values, an f16-rounded scale (Q8_0).
    Q8_0,
    /// 256 values, an f32 scale (Q8_K).
    Q8K,
}

impl ActBlocks {
    /// Values a block.
    pub fn values(self) -> u32 {
        match self {
            ActBlocks::Q8_0 => 32,
            ActBlocks::Q8K => 256,
        }
    }
}

macro_rules! source {
    ($skel:literal, $file:literal, $n:literal, $r:literal, $red:literal, $p:literal) => {
        concat!(
            "const N: u32 = ",
            $n,
            "u;\nconst R: u32 = ",
            $r,
            "u;\nconst RED: u32 = ",
            $red,
            "u;\nconst P: u32 = ",
            $p,
            "u;\n",
            include_str!(concat!("../shaders/", $skel)),
            include_str!("../shaders/reduce_slot.wgsl"),
            include_str!(concat!("../shaders/", $file))
        )
    };
    ($skel:literal, $file:literal, $n:literal, $r:literal, $red:literal, $p:literal, $experts:literal) => {
        concat!(
            source!($skel, $file, $n, $r, $red, $p),
            include_str!(concat!("../shaders/", $experts))
        )
    };
}

/// The eight mat-vec modules of one weight type, path and P (1: one matrix; 2: a gate|up pair
/// with SwiGLU), named `{prefix}{label}_n{N}`. A pair's thread carries half the weight rows of
/// each matrix ([`PAIR_ROWS_PER_THREAD`]), so that it holds as many rows and partial sums as a
/// single product's and the pair launches twice the workgroups.
macro_rules! rows {
    ($prefix:literal, $label:literal, $skel:literal, $file:literal, 1) => {
        rows!(@ $prefix, $label, $skel, $file, 1,
            [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 1, 4), (5, 1, 5), (6, 1, 6), (7, 1, 7), (8, 1, 8)])
    };
    ($prefix:literal, $label:literal, $skel:literal, $file:literal, 2) => {
        rows!(@ $prefix, $label, $skel, $file, 2,
            [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 1, 4), (5, 1, 5), (6, 1, 6), (7, 1, 7), (8, 1, 8)])
    };
    (@ $prefix:literal, $label:literal, $skel:literal, $file:literal, $p:literal,
        [$(($n:literal, $r:literal, $red:literal)),*]) => {
        [$(
            Kernel {
                name: concat!($prefix, $label, "_n", $n),
                source: source!($skel, $file, $n, $r, $red, $p),
                entry: "matvec",
            },
        )*]
    };
}

macro_rules! family {
    ($id:ident, $label:literal, $skel:literal, $experts:literal, $file:literal, $embed:expr) => {
        pub static $id: Family = Family {
            rows: rows!("matvec_", $label, $skel, $file, 1),
            tile: Kernel {
                name: concat!("matmul_", $label, "_tile"),
                source: source!($skel, $file, 32, 1, 16, 1),
                entry: "matvec",
            },
            experts: Kernel {
                name: concat!("matvec_experts_", $label),
                source: source!($skel, $file, 1, 1, 1, 1, $experts),
                entry: "matvec_experts",
            },
            pair_rows: rows!("swiglu_", $label, $skel, $file, 2),
            pair_tile: Kernel {
                name: concat!("swiglu_", $label, "_tile"),
                source: source!($skel, $file, 32, 1, 8, 2),
                entry: "matvec",
            },
            embed: $embed,
        };
    };
    ($id:ident, $label:literal, $file:literal) => {
        family!(
            $id,
            $label,
            "matvec.wgsl",
            "matvec_experts.wgsl",
            $file,
            Some(Kernel {
                name: concat!("embed_", $label),
                source: concat!(
                    include_str!("../shaders/embed.wgsl"),
                    include_str!(concat!("../shaders/", $file))
                ),
                entry: "embed_rows",
            })
        );
    };
    (int8 $id:ident, $label:literal, $file:literal) => {
        family!(
            $id,
            $label,
            "matvec_i8.wgsl",
            "matvec_i8_experts.wgsl",
            $file,
            None
        );
    };
}

family!(Q8_0, "q8_0", "matvec_q8_0.wgsl");
family!(Q4_0, "q4_0", "matvec_q4_0.wgsl");
family!(Q4_1, "q4_1", "matvec_q4_1.wgsl");
family!(Q5_0, "q5_0", "matvec_q5_0.wgsl");
family!(Q5_1, "q5_1", "matvec_q5_1.wgsl");
family!(IQ4_NL, "iq4_nl", "matvec_iq4_nl.wgsl");
family!(MXFP4, "mxfp4", "matvec_mxfp4.wgsl");
family!(Q2_K, "q2_k", "matvec_q2_k.wgsl");
family!(Q3_K, "q3_k", "matvec_q3_k.wgsl");
family!(Q4_K, "q4_k", "matvec_q4_k.wgsl");
family!(Q5_K, "q5_k", "matvec_q5_k.wgsl");
family!(Q6_K, "q6_k", "matvec_q6_k.wgsl");
family!(IQ4_XS, "iq4_xs", "matvec_iq4_xs.wgsl");
family!(F32, "f32", "matvec_f32.wgsl");
family!(F16, "f16", "matvec_f16.wgsl");
family!(BF16, "bf16", "matvec_bf16.wgsl");

family!(int8 Q8_0_I8, "q8_0_i8", "matvec_i8_q8_0.wgsl");
family!(int8 Q4_0_I8, "q4_0_i8", "matvec_i8_q4_0.wgsl");
family!(int8 Q4_K_I8, "q4_k_i8", "matvec_i8_q4_k.wgsl");
family!(int8 Q5_K_I8, "q5_k_i8", "matvec_i8_q5_k.wgsl");
family!(int8 Q6_K_I8, "q6_k_i8", "matvec_i8_q6_k.wgsl");
family!(int8 IQ4_XS_I8, "iq4_xs_i8", "matvec_i8_iq4_xs.wgsl");

/// Activation rows quantized to int8 for the int8 path.
pub static QUANTIZE_Q8: Kernel = Kernel {
    name: "quantize_q8",
    source: concat!(
        include_str!("../shaders/quant_common.wgsl"),
        include_str!("../shaders/quantize_q8.wgsl")
    ),
    entry: "quantize_q8",
};

static FAMILIES: [&Family; 22] = [
    &Q8_0, &Q4_0, &Q4_1, &Q5_0, &Q5_1, &IQ4_NL, &MXFP4, &Q2_K, &Q3_K, &Q4_K, &Q5_K, &Q6_K, &IQ4_XS,
    &F32, &F16, &BF16, &Q8_0_I8, &Q4_0_I8, &Q4_K_I8, &Q5_K_I8, &Q6_K_I8, &IQ4_XS_I8,
];

/// Every matvec kernel, for [`super::all`].
pub fn kernels() -> Vec<&'static Kernel> {
    FAMILIES
        .iter()
        .flat_map(|f| {
            f.rows
                .iter()
                .chain([&f.tile, &f.experts])
                .chain(f.pair_rows.iter())
                .chain([&f.pair_tile])
                .chain(f.embed.as_ref())
        })
        .chain(std::iter::once(&QUANTIZE_Q8))
        .collect()
}

/// log2 of the threads that share one weight row: as many as the row has units, up to the
/// whole workgroup. A function of the matrix's shape only, so that every batch size and the
/// experts kernel add a row's partial sums in the same tree.
fn tpr_log2(units_per_row: usize) -> u32 {
    let units = units_per_row.max(1) as u64;
    (63 - units.leading_zeros()).min(WG.trailing_zeros())
}

/// log2 of the threads that share one weight block on the int8 path: enough that a row's units
/// reach `row_threads`, at most one a 32-value sub-block. A function of the matrix's shape and
/// type (and the device's setting) only, as [`tpr_log2`] is.
fn split_log2(blocks_per_row: usize, act: ActBlocks, row_threads: u32) -> u32 {
    let subs = (act.values() / 32) as usize;
    let want = (row_threads as usize)
        .div_ceil(blocks_per_row.max(1))
        .next_power_of_two();
    want.min(subs).trailing_zeros()
}

/// The units a weight row is cut into and log2 of the threads that share a block (0 on the f32
/// path, whose units are already parts of blocks).
fn row_units(pk: &Packed, row_threads: u32) -> (usize, u32) {
    match pk.int8_path() {
        Some((_, act)) => {
            let split = split_log2(pk.bpr, act, row_threads);
            (pk.bpr << split, split)
        }
        None => (pk.units_per_row(), 0),
    }
}

/// One dispatch of a batch: the module (`N`, 1..=8, or a tile), its first activation row and
/// its groups along z (each `N` rows further).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Step {
    module: Module,
    batch0: u32,
    z: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Module {
    Rows(u32),
    Tile,
}

impl Module {
    fn n(self) -> u32 {
        match self {
            Module::Rows(n) => n,
            Module::Tile => TILE_ROWS,
        }
    }
    fn rows_per_thread(self, pair: bool) -> u32 {
        match (self, pair) {
            (Module::Rows(n), false) => ROWS_PER_THREAD[n as usize - 1],
            (Module::Rows(n), true) => PAIR_ROWS_PER_THREAD[n as usize - 1],
            (Module::Tile, _) => TILE_R,
        }
    }
}

/// The dispatches of `n` activation rows: tiles of [`TILE_ROWS`] while that many remain (more
/// than [`MAX_BATCH`] rows in all), then groups of [`MAX_BATCH`], then the rest in one.
fn plan(n: u32, max_z: u32) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut push = |module: Module, first: u32, count: u32| {
        let mut done = 0;
        while done < count {
            let z = (count - done).min(max_z.max(1));
            steps.push(Step {
                module,
                batch0: first + done * module.n(),
                z,
            });
            done += z;
        }
    };
    let mut at = 0;
    if n > MAX_BATCH {
        let tiles = n / TILE_ROWS;
        push(Module::Tile, 0, tiles);
        at = tiles * TILE_ROWS;
        let groups = (n - at) / MAX_BATCH;
        push(Module::Rows(MAX_BATCH), at, groups);
        at += groups * MAX_BATCH;
    }
    if at < n {
        push(Module::Rows(n - at), at, 1);
    }
    steps
}

fn rows_per_group(module: Module, pair: bool, tpr_log2: u32) -> u32 {
    (WG >> tpr_log2) * module.rows_per_thread(pair)
}

fn bad(m: &Packed, why: String) -> GpuError {
    GpuError::BadTensor {
        tensor: m.name.clone(),
        why,
    }
}

/// Whether `count` rows of `width` values, `stride` apart from `off`, lie within `buf` (f32).
fn check_extent(
    m: &Packed,
    what: &str,
    buf: &wgpu::Buffer,
    off: u32,
    stride: u32,
    count: u64,
    width: u64,
) -> Result<(), GpuError> {
    let end = off as u64 + (count - 1) * stride as u64 + width;
    let have = buf.size() / 4;
    if end > have {
        return Err(bad(
            m,
            format!("{what} needs {end} values from its buffer, which holds {have}"),
        ));
    }
    if end > u32::MAX as u64 {
        return Err(bad(m, format!("{what} reaches past 2^32 values")));
    }
    Ok(())
}

struct Io<'a> {
    x: &'a wgpu::Buffer,
    x_off: u32,
    x_stride: u32,
    y: &'a wgpu::Buffer,
    y_off: u32,
    y_stride: u32,
}

/// Checks shared by both entry points: `x_rows` rows of x and `y_rows` rows of y.
fn check_io(m: &Packed, io: &Io, x_rows: u64, y_rows: u64) -> Result<(), GpuError> {
    if io.x == io.y {
        return Err(bad(m, "x and y are the same buffer".into()));
    }
    if io.x.size() < 16 {
        return Err(bad(m, "the x buffer is smaller than 16 bytes".into()));
    }
    check_extent(m, "x", io.x, io.x_off, io.x_stride, x_rows, m.cols as u64)?;
    check_extent(m, "y", io.y, io.y_off, io.y_stride, y_rows, m.rows as u64)?;
    if y_rows > 1 && (io.y_stride as u64) < m.rows as u64 {
        return Err(bad(
            m,
            format!(
                "y rows {} apart overlap rows of {} values",
                io.y_stride, m.rows
            ),
        ));
    }
    Ok(())
}

fn x_aligned(io: &Io, x_rows: u64) -> u32 {
    (io.x_off.is_multiple_of(4) && (x_rows == 1 || io.x_stride.is_multiple_of(4))) as u32
}

/// Where a quantized activation row keeps its parts: `stride` u32 words a row (a multiple of
/// 4), the packed int8 values from word 0 (`cols / 4` words), the f32 block scales from word
/// `d_off`. Row `i` of a buffer of quantized rows starts at word `i * stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantLayout {
    pub stride: u32,
    pub d_off: u32,
    /// Blocks a row.
    pub blocks: u32,
}

/// The layout of quantized rows of `cols` values in `kind` blocks; `None` when `cols` is not a
/// whole number of blocks.
pub fn quant_layout(cols: usize, kind: ActBlocks) -> Option<QuantLayout> {
    let block = kind.values() as usize;
    if cols == 0 || !cols.is_multiple_of(block) {
        return None;
    }
    let nb = cols / block;
    let stride = cols / 4 + nb.next_multiple_of(4);
    Some(QuantLayout {
        stride: u32::try_from(stride).ok()?,
        d_off: (cols / 4) as u32,
        blocks: nb as u32,
    })
}

/// Quantized copies a kernel makes of its output rows for the int8 products that read them
/// (Q8_0 and/or Q8_K blocks, in the layout [`quant_layout`] gives): output row `i` goes to row
/// `row0 + i`.
#[derive(Clone, Copy, Default)]
pub struct QuantOut<'a> {
    pub q8_0: Option<&'a wgpu::Buffer>,
    pub q8k: Option<&'a wgpu::Buffer>,
    pub row0: u32,
}

/// `rows` activation rows quantized for the int8 path, and their layout.
struct Quantized {
    buffer: wgpu::Buffer,
    layout: QuantLayout,
}

/// Record the quantization of `rows` rows of `x` (`cols` values, `x_stride` apart from `x_off`)
/// into the scratch buffer for quantized activations ([`quant_layout`]).
fn quantize_rows(
    rec: &mut Recorder,
    m: &Packed,
    act: ActBlocks,
    io: &Io,
    rows: u64,
) -> Result<Quantized, GpuError> {
    let cols = m.cols as u64;
    let layout = quant_layout(m.cols, act).ok_or_else(|| {
        bad(
            m,
            format!(
                "{cols} columns is not a whole number of {}-value activation blocks",
                act.values()
            ),
        )
    })?;
    let words = rows * layout.stride as u64;
    let total_blocks = rows * layout.blocks as u64;
    if words > u32::MAX as u64 || total_blocks > u32::MAX as u64 {
        return Err(bad(m, format!("{rows} quantized activation rows")));
    }
    let gpu = rec.gpu();
    let buffer = gpu.scratch("x-int8", (words * 4).next_multiple_of(16))?;
    let params = [
        rows as u32,
        cols as u32,
        io.x_off,
        io.x_stride,
        layout.stride,
        layout.d_off,
        (act == ActBlocks::Q8K) as u32,
        layout.blocks,
    ];
    let groups = crate::groups_1d(gpu, (total_blocks as u32).div_ceil(64));
    // The f32 rows read, their quantized words written.
    let bytes = rows * (cols * 4 + layout.stride as u64 * 4);
    rec.dispatch(&QUANTIZE_Q8, &params, &[io.x, &buffer], groups, bytes)?;
    Ok(Quantized { buffer, layout })
}

/// The activation rows of a product: the f32 rows (`x`, `stride` apart from `off`), and, when a
/// kernel before already made them, the same rows quantized in Q8_0 or Q8_K blocks in the
/// layout [`quant_layout`] gives (row `i` of the product at row `i`). A product on the int8
/// path uses the quantized rows of its blocks when given and quantizes `x` otherwise.
#[derive(Clone, Copy)]
pub struct Acts<'a> {
    pub x: &'a wgpu::Buffer,
    pub off: u32,
    pub stride: u32,
    pub q8_0: Option<&'a wgpu::Buffer>,
    pub q8k: Option<&'a wgpu::Buffer>,
}

impl<'a> Acts<'a> {
    /// f32 rows only.
    pub fn f32(x: &'a wgpu::Buffer, off: u32, stride: u32) -> Self {
        Acts {
            x,
            off,
            stride,
            q8_0: None,
            q8k: None,
        }
    }
}

/// What a product does with its results beside computing them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Epilogue {
    /// Add them to what `y` holds (a residual) instead of storing them.
    pub add: bool,
    /// The tensor's scale, multiplied into every result.
    pub scale: f32,
}

impl Default for Epilogue {
    fn default() -> Self {
        Epilogue {
            add: false,
            scale: 1.0,
        }
    }
}

/// The quantized rows a product on the int8 path reads: the ones given, checked, or `x`
/// quantized now.
fn quantized_input(
    rec: &mut Recorder,
    pk: &Packed,
    act: ActBlocks,
    acts: &Acts,
    io: &Io,
    rows: u64,
) -> Result<Quantized, GpuError> {
    let given = match act {
        ActBlocks::Q8_0 => acts.q8_0,
        ActBlocks::Q8K => acts.q8k,
    };
    let Some(buffer) = given else {
        return quantize_rows(rec, pk, act, io, rows);
    };
    let layout = quant_layout(pk.cols, act)
        .ok_or_else(|| bad(pk, format!("{} columns in {act:?} blocks", pk.cols)))?;
    let need = rows * layout.stride as u64 * 4;
    if buffer.size() < need {
        return Err(bad(
            pk,
            format!(
                "{rows} quantized rows need {need} bytes, the buffer holds {}",
                buffer.size()
            ),
        ));
    }
    Ok(Quantized {
        buffer: buffer.clone(),
        layout,
    })
}

/// `y[y_off + i*y_stride + r] = sum_c W[r][c] * x[x_off + i*x_stride + c]` for `i < n` and every
/// row `r` of `m`, accumulated in f32; on the f32 path ([`DeviceMatrix::int8`] false) with the
/// f32 activations, on the int8 path with each row quantized first (see the module's notes).
/// Up to [`MAX_BATCH`] rows of x share one read of the weights; a batch of more rows goes in
/// tiles of [`TILE_ROWS`], then groups of [`MAX_BATCH`] and the rest. Row `i`'s result is the
/// same bits whatever `n` is and wherever the row sits. `x` and `y` are distinct buffers of f32;
/// the y rows must not overlap (`y_stride >= rows` when `n > 1`).
#[allow(clippy::too_many_arguments)]
pub fn matvec(
    rec: &mut Recorder,
    m: &DeviceMatrix,
    x: &wgpu::Buffer,
    x_off: u32,
    x_stride: u32,
    n: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    y_stride: u32,
) -> Result<(), GpuError> {
    product(
        rec,
        m,
        &Acts::f32(x, x_off, x_stride),
        n,
        y,
        y_off,
        y_stride,
        Epilogue::default(),
    )
}

/// [`matvec`] over `acts` (quantized rows a kernel before made are used as they are), with the
/// results stored or added to `y` and scaled as `epilogue` says. For a gate|up pair
/// ([`DeviceMatrix::is_pair`]) the result of row `r` is `SiLU(gate_r · x) * (up_r · x)`, `y`
/// rows being [`DeviceMatrix::rows`] (one matrix's rows) wide; each product in it has the bits
/// [`matvec`] gives for that matrix alone.
#[allow(clippy::too_many_arguments)]
pub fn product(
    rec: &mut Recorder,
    m: &DeviceMatrix,
    acts: &Acts,
    n: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    y_stride: u32,
    epilogue: Epilogue,
) -> Result<(), GpuError> {
    if n == 0 {
        return Ok(());
    }
    let pk = m.packed();
    let io = Io {
        x: acts.x,
        x_off: acts.off,
        x_stride: acts.stride,
        y,
        y_off,
        y_stride,
    };
    check_io(pk, &io, n as u64, n as u64)?;
    let gpu = rec.gpu();
    let steps = plan(n, gpu.max_groups_x());
    let quantized = match pk.int8_path() {
        Some((family, act)) => Some((family, quantized_input(rec, pk, act, acts, &io, n as u64)?)),
        None => None,
    };
    let (units, split) = row_units(pk, gpu.row_threads());
    let tl = tpr_log2(units);
    let aligned = x_aligned(&io, n as u64);
    let pair = pk.pair;
    let mode = epilogue.add as u32 | (pair as u32) << 1;
    let scale = epilogue.scale.to_bits();
    let kernel = |module: Module, family: &'static Family| -> &'static Kernel {
        match (module, pair) {
            (Module::Rows(k), false) => &family.rows[k as usize - 1],
            (Module::Tile, false) => &family.tile,
            (Module::Rows(k), true) => &family.pair_rows[k as usize - 1],
            (Module::Tile, true) => &family.pair_tile,
        }
    };
    for chunk in &pk.chunks {
        // A pair's chunk holds its gate rows, then as many up rows.
        let rows = if pair { chunk.rows / 2 } else { chunk.rows } as u32;
        let half = if pair { rows } else { 0 };
        let y_row0 = if pair {
            chunk.first_row / 2
        } else {
            chunk.first_row
        } as u32;
        for step in &steps {
            let blocks = rows.div_ceil(rows_per_group(step.module, pair, tl));
            let mut groups = crate::groups_1d(gpu, blocks);
            groups[2] = step.z;
            // The chunk's weights once, the step's activation rows, its output rows (read too
            // when added to).
            let batch = (step.z * step.module.n()) as u64;
            let act_row = match &quantized {
                Some((_, q)) => q.layout.stride as u64 * 4,
                None => pk.cols as u64 * 4,
            };
            let out_row = rows as u64 * 4 * (1 + u64::from(epilogue.add));
            let bytes = chunk.buffer.size() + batch * (act_row + out_row);
            match &quantized {
                Some((family, q)) => {
                    let params = [
                        rows,
                        pk.bpr as u32,
                        tl,
                        chunk.aux_off,
                        chunk.aux2_off,
                        q.layout.stride,
                        q.layout.d_off,
                        y_off,
                        y_stride,
                        y_row0,
                        step.batch0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        mode,
                        scale,
                        half,
                        split,
                    ];
                    rec.dispatch(
                        kernel(step.module, family),
                        &params,
                        &[&chunk.buffer, &q.buffer, y],
                        groups,
                        bytes,
                    )?;
                }
                None => {
                    let params = [
                        rows,
                        units as u32,
                        tl,
                        pk.bpr as u32,
                        chunk.aux_off,
                        chunk.aux2_off,
                        pk.cols as u32,
                        acts.off,
                        acts.stride,
                        aligned,
                        y_off,
                        y_stride,
                        y_row0,
                        step.batch0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        0,
                        mode,
                        scale,
                        half,
                    ];
                    rec.dispatch(
                        kernel(step.module, pk.format.family),
                        &params,
                        &[&chunk.buffer, acts.x, acts.x, y],
                        groups,
                        bytes,
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// Ids at or above this stand for a token a device pass drafted and has not read back:
/// `DEVICE_TOKEN + k` is the id in the first word of pair `k` of the drafts buffer
/// ([`embed_rows`]). Above every vocabulary, below the engine's image placeholder ids.
pub const DEVICE_TOKEN: u32 = 0x7F00_0000;

/// Rows of `m` as an embedding table: for `i < n`, row `ids[ids_off + i]` of `m` dequantized
/// into `out[out_off + i * out_stride ..][..cols]`, each value the host's dequantization of the
/// same row bit for bit. An id at or above [`DEVICE_TOKEN`] is looked up in `drafts` (u32 pairs
/// (id, logit bits), as [`crate::kernels::argmax::argmax_rows`] writes them); an id outside the
/// table gives zeros.
#[allow(clippy::too_many_arguments)]
pub fn embed_rows(
    rec: &mut Recorder,
    m: &DeviceMatrix,
    ids: &wgpu::Buffer,
    ids_off: u32,
    drafts: &wgpu::Buffer,
    n: u32,
    out: &wgpu::Buffer,
    out_off: u32,
    out_stride: u32,
) -> Result<(), GpuError> {
    let pk = m.packed();
    if n == 0 {
        return Ok(());
    }
    if pk.pair {
        return Err(bad(pk, "a gate|up pair is not an embedding table".into()));
    }
    let Some(kernel) = pk.format.family.embed.as_ref() else {
        return Err(bad(pk, format!("{} rows cannot be gathered", pk.ty)));
    };
    if pk.rows as u64 >= DEVICE_TOKEN as u64 {
        return Err(bad(
            pk,
            format!("{} rows reach the drafted-token ids", pk.rows),
        ));
    }
    check_extent(
        pk,
        "output",
        out,
        out_off,
        out_stride,
        n as u64,
        pk.cols as u64,
    )?;
    if ids.size() / 4 < ids_off as u64 + n as u64 {
        return Err(bad(pk, format!("{n} ids from {ids_off} past their buffer")));
    }
    let gpu = rec.gpu();
    if n > gpu.max_groups_x() {
        return Err(bad(pk, format!("{n} rows gathered in one dispatch")));
    }
    let groups = [(pk.cols as u32).div_ceil(256), n, 1];
    for (i, chunk) in pk.chunks.iter().enumerate() {
        let params = [
            chunk.rows as u32,
            chunk.first_row as u32,
            pk.units_per_row() as u32,
            pk.bpr as u32,
            chunk.aux_off,
            chunk.aux2_off,
            pk.cols as u32,
            n,
            ids_off,
            out_off,
            out_stride,
            (i == 0) as u32,
            pk.rows as u32,
            DEVICE_TOKEN,
        ];
        // The ids, and (counted with the first chunk, which writes every row) each gathered row
        // read and written once.
        let row_bytes = chunk.buffer.size() / (chunk.rows as u64).max(1);
        let rows = if i == 0 {
            n as u64 * (row_bytes + pk.cols as u64 * 4)
        } else {
            0
        };
        let bytes = n as u64 * 4 + rows;
        rec.dispatch(
            kernel,
            &params,
            &[&chunk.buffer, ids, drafts, out],
            groups,
            bytes,
        )?;
    }
    Ok(())
}

/// The experts a router picked, each times its activation row. For token `i < n` and slot
/// `s < n_used`, expert `e = ids[ids_off + i*n_used + s]` (u32) multiplies the row
/// `x[x_off + j*x_stride ..]` with `j = i*n_used + s` when `x_per_slot` (each slot its own
/// input, as the down projection), `j = i` otherwise (the token's input, as gate and up), into
/// `y[y_off + (i*n_used + s)*y_stride + r]` for every row `r` of the expert. Each output row is
/// the same bits as [`matvec`] on expert `e`'s matrix alone (on the same path,
/// [`DeviceExperts::int8`]). Rows of an id not below the number of experts are left as they
/// were.
#[allow(clippy::too_many_arguments)]
pub fn matvec_experts(
    rec: &mut Recorder,
    m: &DeviceExperts,
    ids: &wgpu::Buffer,
    ids_off: u32,
    n_used: u32,
    x: &wgpu::Buffer,
    x_off: u32,
    x_stride: u32,
    x_per_slot: bool,
    n: u32,
    y: &wgpu::Buffer,
    y_off: u32,
    y_stride: u32,
) -> Result<(), GpuError> {
    let pairs = n as u64 * n_used as u64;
    if pairs == 0 {
        return Ok(());
    }
    let pk = m.packed();
    let io = Io {
        x,
        x_off,
        x_stride,
        y,
        y_off,
        y_stride,
    };
    let x_rows = if x_per_slot { pairs } else { n as u64 };
    check_io(pk, &io, x_rows, pairs)?;
    if ids_off as u64 + pairs > ids.size() / 4 {
        return Err(bad(
            pk,
            format!(
                "ids needs {} values from its buffer, which holds {}",
                ids_off as u64 + pairs,
                ids.size() / 4
            ),
        ));
    }
    if ids == x || ids == y {
        return Err(bad(pk, "ids shares a buffer with x or y".into()));
    }
    let gpu = rec.gpu();
    let max_z = gpu.max_groups_x().max(1) as u64;
    let quantized = match pk.int8_path() {
        Some((family, act)) => Some((family, quantize_rows(rec, pk, act, &io, x_rows)?)),
        None => None,
    };
    let (units, split) = row_units(pk, gpu.row_threads());
    let tl = tpr_log2(units);
    let aligned = x_aligned(&io, x_rows);
    let blocks = (pk.rows as u32).div_ceil(rows_per_group(Module::Rows(1), false, tl));
    let one = 1f32.to_bits();
    for chunk in &pk.chunks {
        let mut pair0 = 0u64;
        let e_base = (chunk.first_row / pk.rows) as u32;
        let e_count = (chunk.rows / pk.rows) as u32;
        while pair0 < pairs {
            let z = (pairs - pair0).min(max_z);
            let mut groups = crate::groups_1d(gpu, blocks);
            groups[2] = z as u32;
            // Which experts the pairs pick is on the device: the weights of as many of the
            // chunk's experts as there are pairs (at most all of them), each pair's activation
            // row and its output row.
            let expert_bytes = chunk.buffer.size() / (e_count as u64).max(1);
            let act_row = match &quantized {
                Some((_, q)) => q.layout.stride as u64 * 4,
                None => pk.cols as u64 * 4,
            };
            let bytes = z.min(e_count as u64) * expert_bytes + z * (act_row + pk.rows as u64 * 4);
            match &quantized {
                Some((family, q)) => {
                    let params = [
                        pk.rows as u32,
                        pk.bpr as u32,
                        tl,
                        chunk.aux_off,
                        chunk.aux2_off,
                        q.layout.stride,
                        q.layout.d_off,
                        y_off,
                        y_stride,
                        0,
                        0,
                        n_used,
                        ids_off,
                        e_base,
                        e_count,
                        x_per_slot as u32,
                        pair0 as u32,
                        0,
                        one,
                        0,
                        split,
                    ];
                    rec.dispatch(
                        &family.experts,
                        &params,
                        &[&chunk.buffer, &q.buffer, y, ids],
                        groups,
                        bytes,
                    )?;
                }
                None => {
                    let params = [
                        pk.rows as u32,
                        units as u32,
                        tl,
                        pk.bpr as u32,
                        chunk.aux_off,
                        chunk.aux2_off,
                        pk.cols as u32,
                        x_off,
                        x_stride,
                        aligned,
                        y_off,
                        y_stride,
                        0,
                        0,
                        n_used,
                        ids_off,
                        e_base,
                        e_count,
                        x_per_slot as u32,
                        pair0 as u32,
                        0,
                        one,
                        0,
                    ];
                    rec.dispatch(
                        &pk.format.family.experts,
                        &params,
                        &[&chunk.buffer, x, x, y, ids],
                        groups,
                        bytes,
                    )?;
                }
            }
            pair0 += z;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_constants_match_the_host() {
        for f in FAMILIES {
            for (i, k) in f.rows.iter().enumerate() {
                let (n, r) = (i as u32 + 1, ROWS_PER_THREAD[i]);
                let head = format!(
                    "const N: u32 = {n}u;\nconst R: u32 = {r}u;\nconst RED: u32 = {}u;\nconst P: u32 = 1u;\n",
                    n * r
                );
                assert!(k.source.starts_with(&head), "{}", k.name);
                // A pair's thread reduces all its rows in one round: twice its partial sums
                // fit 16 KB.
                let pk = &f.pair_rows[i];
                let r = PAIR_ROWS_PER_THREAD[i];
                let head = format!(
                    "const N: u32 = {n}u;\nconst R: u32 = {r}u;\nconst RED: u32 = {}u;\nconst P: u32 = 2u;\n",
                    n * r
                );
                assert!(pk.source.starts_with(&head), "{}", pk.name);
                assert!(128 * n * r * 2 * 4 <= 16384);
                assert_eq!(pk.name, format!("swiglu_{}", &k.name["matvec_".len()..]));
                assert!(k.source.contains(&format!("const WG: u32 = {WG}u;")));
            }
            let head = format!(
                "const N: u32 = {TILE_ROWS}u;\nconst R: u32 = {TILE_R}u;\nconst RED: u32 = {TILE_RED}u;\nconst P: u32 = 1u;\n"
            );
            assert!(f.tile.source.starts_with(&head), "{}", f.tile.name);
            assert!((TILE_ROWS * TILE_R).is_multiple_of(TILE_RED));
            assert!(f.experts.source.starts_with(f.rows[0].source));
        }
    }

    #[test]
    fn threads_per_row() {
        assert_eq!(tpr_log2(1), 0);
        assert_eq!(tpr_log2(16), 4);
        assert_eq!(tpr_log2(17), 4);
        assert_eq!(tpr_log2(127), 6);
        assert_eq!(tpr_log2(128), 7);
        assert_eq!(tpr_log2(100_000), 7);
    }

    /// A narrow row's blocks are shared until the row spreads over a subgroup's worth of threads,
    /// never finer than a 32-value sub-block.
    #[test]
    fn narrow_int8_rows_share_their_blocks() {
        // Q8_K blocks (256 values, 8 sub-blocks) at widths 256, 1024, 2048, 3584, 5120, 17408.
        let cases = [(1, 3), (4, 3), (8, 2), (14, 2), (20, 1), (68, 0)];
        for (blocks, want) in cases {
            assert_eq!(
                split_log2(blocks, ActBlocks::Q8K, GPU_ROW_THREADS),
                want,
                "{blocks} blocks"
            );
            let units = blocks << want;
            assert!(units >= (GPU_ROW_THREADS as usize).min(blocks * 8));
            // A block a thread where one thread a row is asked for.
            assert_eq!(split_log2(blocks, ActBlocks::Q8K, 1), 0);
        }
        // Q8_0 blocks are a single sub-block.
        for blocks in [1, 8, 32, 160] {
            assert_eq!(split_log2(blocks, ActBlocks::Q8_0, GPU_ROW_THREADS), 0);
        }
    }

    /// Every row is covered once, by tiles first when the batch is longer than a group.
    #[test]
    fn batches_are_planned_in_tiles_then_groups() {
        for n in 1..=200u32 {
            for max_z in [1, 2, 65535] {
                let steps = plan(n, max_z);
                let mut covered = Vec::new();
                for s in &steps {
                    assert!(s.z >= 1 && s.z <= max_z);
                    for zi in 0..s.z {
                        let first = s.batch0 + zi * s.module.n();
                        covered.extend(first..first + s.module.n());
                    }
                }
                assert_eq!(covered, (0..n).collect::<Vec<_>>(), "n {n} max_z {max_z}");
                let tiles: u32 = steps
                    .iter()
                    .filter(|s| s.module == Module::Tile)
                    .map(|s| s.z)
                    .sum();
                let want = if n > MAX_BATCH { n / TILE_ROWS } else { 0 };
                assert_eq!(tiles, want, "n {n}");
            }
        }
    }
}
