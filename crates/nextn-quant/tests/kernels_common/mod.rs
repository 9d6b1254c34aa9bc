//! Shared helpers for the kernel tests: a small deterministic RNG, random but well-formed
//! weight matrices in every type, activations, and error bounds.
#![allow(dead_code)]

use nextn_quant::kernels::{SimdLevel, SUPPORTED_WEIGHT_TYPES};
use nextn_quant::{formats, GgmlType};

/// xorshift64* — deterministic across platforms, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
    pub fn sign(&mut self) -> f32 {
        if self.next_u64() & 1 == 0 {
            1.0
        } else {
            -1.0
        }
    }
}

pub fn all_types() -> &'static [GgmlType] {
    &SUPPORTED_WEIGHT_TYPES
}

/// The SIMD levels to compare against the reference on this machine (not Scalar). A level of
/// this architecture that the CPU lacks is reported as skipped (and fails under `CI=true` where
/// every CI machine has it).
pub fn simd_levels_under_test() -> Vec<SimdLevel> {
    let ours: &[SimdLevel] = if cfg!(target_arch = "x86_64") {
        &[SimdLevel::Avx2, SimdLevel::Avx512]
    } else if cfg!(target_arch = "aarch64") {
        &[SimdLevel::Neon]
    } else {
        &[]
    };
    let mut levels = Vec::new();
    for &level in ours {
        if level.is_supported() {
            levels.push(level);
        } else {
            nextn_testdata::cpu_feature_missing(
                &level.to_string(),
                &format!("the {level} kernels against the reference"),
            );
        }
    }
    levels
}

fn put_f16(dst: &mut [u8], at: usize, v: f32) {
    dst[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

/// A plausible block scale: random magnitude and sign.
fn scale(rng: &mut Rng) -> f32 {
    rng.sign() * rng.uniform(0.001, 0.03)
}

/// Byte offsets of a type's f16 (or f32 for Q8_K) scale fields: (main scales, minimum scales).
fn scale_fields(ty: GgmlType) -> (&'static [usize], &'static [usize]) {
    use GgmlType as T;
    match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::IQ4_XS => (&[0], &[]),
        T::Q4_1 | T::Q5_1 | T::Q4_K | T::Q5_K => (&[0], &[2]),
        T::Q2_K => (&[80], &[82]),
        T::Q3_K => (&[108], &[]),
        T::Q6_K => (&[208], &[]),
        _ => (&[], &[]),
    }
}

/// A `rows × cols` matrix of random but well-formed blocks (finite, moderate scales; all
/// other bits random, so every quant value and sub-scale occurs).
pub fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols;
    match ty {
        GgmlType::F32 => (0..n)
            .flat_map(|_| rng.uniform(-1.0, 1.0).to_le_bytes())
            .collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| {
                half::f16::from_f32(rng.uniform(-1.0, 1.0))
                    .to_bits()
                    .to_le_bytes()
            })
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| {
                half::bf16::from_f32(rng.uniform(-1.0, 1.0))
                    .to_bits()
                    .to_le_bytes()
            })
            .collect(),
        _ => {
            let (bs, ts) = (ty.block_size(), ty.type_size());
            let nblocks = n / bs;
            let mut data: Vec<u8> = (0..nblocks * ts).map(|_| rng.next_u64() as u8).collect();
            for blk in data.chunks_exact_mut(ts) {
                let (main, mins) = scale_fields(ty);
                for &at in main.iter().chain(mins) {
                    put_f16(blk, at, scale(rng));
                }
                match ty {
                    GgmlType::MXFP4 => blk[0] = 118 + rng.below(14) as u8,
                    GgmlType::Q8_K => blk[0..4].copy_from_slice(&scale(rng).to_le_bytes()),
                    _ => {}
                }
            }
            data
        }
    }
}

/// Activation rows: mostly uniform values, with a few outliers and an all-zero stretch.
pub fn random_acts(n_rows: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n_rows * cols).map(|_| rng.uniform(-1.0, 1.0)).collect();
    for _ in 0..n_rows {
        let j = rng.below(x.len() as u64) as usize;
        x[j] *= 25.0;
    }
    if cols >= 512 {
        // A zero 256-block (Q8_K's amax == 0 path) in the first row.
        x[256..512].fill(0.0);
    }
    x
}

/// Dequantize a whole matrix through `formats` (an implementation independent of the
/// kernels).
pub fn dequantize_matrix(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    let rb = data.len() / rows;
    for r in 0..rows {
        formats::dequantize(
            ty,
            &data[r * rb..(r + 1) * rb],
            &mut out[r * cols..(r + 1) * cols],
        )
        .expect("formats::dequantize");
    }
    out
}

/// Per (activation row, weight row): Σ_j |terms|, the scale against which float rounding
/// differences are judged. Weights with an additive minimum are split into the scaled part
/// and the minimum part, since kernels sum those separately and they may cancel.
pub fn magnitude_bounds(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_rows: usize,
) -> Vec<f64> {
    let full = dequantize_matrix(ty, data, rows, cols);
    let (_, min_fields) = scale_fields(ty);
    let scaled = if min_fields.is_empty() {
        full.clone()
    } else {
        let mut no_min = data.to_vec();
        for blk in no_min.chunks_exact_mut(ty.type_size()) {
            for &at in min_fields {
                put_f16(blk, at, 0.0);
            }
        }
        dequantize_matrix(ty, &no_min, rows, cols)
    };
    let mut out = vec![0f64; n_rows * rows];
    for i in 0..n_rows {
        let xi = &x[i * cols..(i + 1) * cols];
        for r in 0..rows {
            let mut s = 0f64;
            for j in 0..cols {
                let (f, sc) = (full[r * cols + j] as f64, scaled[r * cols + j] as f64);
                s += (sc.abs() + (f - sc).abs()) * (xi[j] as f64).abs();
            }
            out[i * rows + r] = s;
        }
    }
    out
}

/// Column counts that exercise odd block counts and (for plain floats) vector tails.
pub fn test_cols(ty: GgmlType) -> usize {
    match ty.block_size() {
        1 => 1003,
        32 => 32 * 37,
        _ => 256 * 5,
    }
}
