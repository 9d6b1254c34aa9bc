//! Row-wise operations of the tower, with ggml's numerics: layer norm, GELU through the f16
//! table, softmax; and `par_rows`, which spreads rows over the pool.

use half::f16;
use nextn_quant::kernels::{exp_nonpositive, ThreadPool};

use crate::weights::Norm;

/// A pointer that tasks share to write disjoint rows of one buffer.
#[derive(Clone, Copy)]
struct RowsPtr(*mut f32);
// SAFETY: `par_rows` hands each task a disjoint range of rows.
unsafe impl Send for RowsPtr {}
// SAFETY: `par_rows` hands each task a disjoint range of rows.
unsafe impl Sync for RowsPtr {}

impl RowsPtr {
    // A method, so that closures capture the wrapper (Sync) rather than its raw pointer field.
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Calls `f(row_index, row)` for every `row_len`-element row of `data`, rows spread over the pool.
pub(crate) fn par_rows(
    pool: &ThreadPool,
    data: &mut [f32],
    row_len: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    if row_len == 0 {
        return;
    }
    let n_rows = data.len() / row_len;
    let n_tasks = (pool.n_threads() * 4).min(n_rows).max(1);
    let per_task = n_rows.div_ceil(n_tasks);
    let ptr = RowsPtr(data.as_mut_ptr());
    pool.run(n_tasks, |t, _| {
        let first = t * per_task;
        let last = ((t + 1) * per_task).min(n_rows);
        for r in first..last {
            // SAFETY: row r lies inside `data` and only this task touches it.
            let row = unsafe { std::slice::from_raw_parts_mut(ptr.at(r * row_len), row_len) };
            f(r, row);
        }
    });
}

/// ggml_norm followed by the weight and bias: `(x - mean) / sqrt(var + eps) * w + b`, with the
/// mean summed in f64 as ggml does.
pub(crate) fn layer_norm_row(x: &[f32], out: &mut [f32], norm: &Norm, eps: f32) {
    let n = x.len();
    let sum: f64 = x.iter().map(|&v| v as f64).sum();
    let mean = (sum as f32) / n as f32;
    let mut var = 0f64;
    for (o, &v) in out.iter_mut().zip(x) {
        let d = v - mean;
        *o = d;
        var += (d * d) as f64;
    }
    let variance = (var / n as f64) as f32;
    let scale = 1.0 / (variance + eps).sqrt();
    for ((o, w), b) in out.iter_mut().zip(&norm.weight).zip(&norm.bias) {
        *o = (*o * scale) * w + b;
    }
}

/// Layer norm of every `n`-element row of `x`.
pub(crate) fn layer_norm(pool: &ThreadPool, x: &[f32], norm: &Norm, eps: f32) -> Vec<f32> {
    let n = norm.weight.len();
    let mut out = vec![0f32; x.len()];
    par_rows(pool, &mut out, n, |r, row| {
        layer_norm_row(&x[r * n..(r + 1) * n], row, norm, eps)
    });
    out
}

const GELU_COEF_A: f32 = 0.044715;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

fn gelu_exact(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// ggml's GELU on the CPU: tanh form, looked up by the input rounded to f16 and rounded to f16
/// itself; identity above 10 and zero below -10.
pub(crate) fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        gelu_table()[f16::from_f32(x).to_bits() as usize]
    }
}

/// The value [`gelu`] gives for every f16 input, as ggml's `ggml_table_gelu_f16`: the tanh
/// form of each of the 65,536 half floats rounded to f16, built once.
fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_exact(f16::from_bits(bits).to_f32())).to_f32())
            .collect()
    })
}

/// GELU in place over all of `x`.
pub(crate) fn gelu_all(pool: &ThreadPool, x: &mut [f32], row_len: usize) {
    par_rows(pool, x, row_len, |_, row| {
        for v in row {
            *v = gelu(*v);
        }
    });
}

/// Lanes of the softmax's maximum and sum: ggml_vec_soft_max_f32 on AVX-512 sums sixteen
/// exponentials in f32 and adds each group to an f64 total.
const LANES: usize = 16;

/// ggml_soft_max_ext without mask: `softmax(scale * x)`, each group of sixteen terms summed in
/// f32 (pairwise) and the groups in f64, as ggml's AVX-512 path does; e^x by
/// [`exp_nonpositive`], the model attention's exponential (ggml too uses its own vector
/// exponential there, not libm's).
pub(crate) fn softmax_scaled(row: &mut [f32], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { softmax_scaled_avx2(row, scale) };
        return;
    }
    softmax_scaled_body(row, scale);
}

/// [`softmax_scaled_body`] compiled with AVX2: the same operations in the same order (AVX2
/// brings no fused multiply-add), so the same bits, on 256-bit vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_scaled_avx2(row: &mut [f32], scale: f32) {
    softmax_scaled_body(row, scale);
}

#[inline(always)]
fn softmax_scaled_body(row: &mut [f32], scale: f32) {
    let wide = row.len() / LANES * LANES;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for c in row[..wide].chunks_exact_mut(LANES) {
        for (l, v) in lanes.iter_mut().zip(c.iter_mut()) {
            *v *= scale;
            *l = if *v > *l { *v } else { *l };
        }
    }
    let mut max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in row[wide..].iter_mut() {
        *v *= scale;
        max = max.max(*v);
    }
    let mut sum = 0f64;
    for c in row[..wide].chunks_exact_mut(LANES) {
        for v in c.iter_mut() {
            *v = exp_nonpositive(*v - max);
        }
        let mut s = [0f32; LANES / 2];
        for (i, p) in s.iter_mut().enumerate() {
            *p = c[i] + c[i + LANES / 2];
        }
        let s = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
        sum += ((s[0] + s[2]) + (s[1] + s[3])) as f64;
    }
    for v in row[wide..].iter_mut() {
        *v = exp_nonpositive(*v - max);
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// `a += b` elementwise.
pub(crate) fn add_into(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += *y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_follows_the_f16_table() {
        assert_eq!(gelu(-11.0), 0.0);
        assert_eq!(gelu(12.5), 12.5);
        assert_eq!(gelu(0.0), 0.0);
        // gelu(1) = 0.8412; the table holds it rounded to f16.
        assert_eq!(gelu(1.0), f16::from_f32(0.841_192).to_f32());
        assert!((gelu(-1.0) + 0.1588).abs() < 1e-3);
    }

    #[test]
    fn layer_norm_centres_and_scales() {
        let norm = Norm {
            weight: vec![2.0; 4],
            bias: vec![1.0; 4],
        };
        let mut out = [0f32; 4];
        layer_norm_row(&[1.0, 2.0, 3.0, 4.0], &mut out, &norm, 1e-6);
        let mean: f32 = out.iter().sum::<f32>() / 4.0;
        assert!((mean - 1.0).abs() < 1e-5);
        assert!((out[3] - (1.0 + 2.0 * 1.5 / 1.25f32.sqrt())).abs() < 1e-4);
    }

    /// The table gives the tanh form of the f16-rounded input, rounded to f16, for every input.
    #[test]
    fn gelu_table_equals_the_formula() {
        for i in -12_000..=12_000 {
            let x = i as f32 / 1000.0;
            let want = if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x
            } else {
                f16::from_f32(gelu_exact(f16::from_f32(x).to_f32())).to_f32()
            };
            assert_eq!(gelu(x).to_bits(), want.to_bits(), "{x}");
        }
    }

    /// Within a few ulp of the softmax in f64 with libm's exponential, on rows with a tail
    /// past the lanes; the vector copy gives the baseline copy's bits.
    #[test]
    fn softmax_matches_the_f64_definition() {
        for n in [1, 15, 16, 17, 100, 3072] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let mut got = x.clone();
            softmax_scaled(&mut got, 0.3);
            let mut base = x.clone();
            softmax_scaled_body(&mut base, 0.3);
            let max = x.iter().map(|&v| (v * 0.3) as f64).fold(f64::MIN, f64::max);
            let e: Vec<f64> = x.iter().map(|&v| ((v * 0.3) as f64 - max).exp()).collect();
            let total: f64 = e.iter().sum();
            for i in 0..n {
                assert_eq!(got[i].to_bits(), base[i].to_bits(), "n {n} row {i}");
                let want = e[i] / total;
                assert!(
                    (got[i] as f64 - want).abs() <= 4e-7 * want + 1e-30,
                    "n {n} row {i}: {} vs {want}",
                    got[i]
                );
            }
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut r = [1.0, 2.0, 3.0];
        softmax_scaled(&mut r, 0.5);
        assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(r[2] > r[1] && r[1] > r[0]);
    }
}
