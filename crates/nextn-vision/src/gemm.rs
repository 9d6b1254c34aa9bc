//! Products of many rows (an image's patches) by a weight matrix: the weights unpacked once per
//! product into f32 panels of [`NR`] outputs, k-major, and a register-blocked kernel of [`MR`]
//! rows by [`NR`] outputs (AVX-512 where the CPU has it). The activations are rounded to the
//! weight type's vec_dot type first (F16 for F16, BF16 for BF16), as ggml's products do, so the
//! results differ from `QMatrix::mul_rows` only by the f32 summation order.

use half::{bf16, f16};
use nextn_gguf::GgmlType;
use nextn_quant::formats::dequantize;
use nextn_quant::kernels::ThreadPool;
use nextn_quant::QuantError;

/// Rows of one kernel block.
const MR: usize = 6;
/// Outputs of one panel (two AVX-512 registers).
const NR: usize = 32;
/// Below this many rows a product goes through `QMatrix::mul_rows` instead.
pub(crate) const MIN_GEMM_ROWS: usize = 16;

/// Whether products by weights of `ty` can take this path.
pub(crate) fn handles(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// The weights, `n` outputs of `k` inputs, as f32 panels: panel `p` holds `k` groups of `NR`
/// values, outputs `p*NR..` (zero past `n`).
pub(crate) struct Panels {
    n: usize,
    k: usize,
    data: Vec<f32>,
}

impl Panels {
    /// From `n` rows of `k` elements of type `ty` (ggml layout).
    pub(crate) fn from_rows(
        ty: GgmlType,
        bytes: &[u8],
        n: usize,
        k: usize,
        pool: &ThreadPool,
    ) -> Result<Panels, QuantError> {
        let n_panels = n.div_ceil(NR);
        let mut data = vec![0f32; n_panels * k * NR];
        let row_bytes = bytes.len() / n.max(1);
        let out = SharedOut(data.as_mut_ptr());
        let failed = std::sync::atomic::AtomicBool::new(false);
        pool.run(n_panels, |p, _| {
            let mut row = vec![0f32; k];
            for j in 0..NR.min(n - p * NR) {
                let r = p * NR + j;
                if dequantize(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row).is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    return;
                }
                for (kk, v) in row.iter().enumerate() {
                    // SAFETY: panel p's elements are written by this task only, inside `data`.
                    unsafe { *out.at((p * k + kk) * NR + j) = *v };
                }
            }
        });
        if failed.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(QuantError::NoSuchOp {
                ty,
                op: "dequantize",
            });
        }
        Ok(Panels { n, k, data })
    }

    /// Plain f32 rows (`n x k`), for the attention products.
    pub(crate) fn from_f32(x: &[f32], n: usize, k: usize) -> Panels {
        let n_panels = n.div_ceil(NR);
        let mut data = vec![0f32; n_panels * k * NR];
        for r in 0..n {
            let (p, j) = (r / NR, r % NR);
            for (kk, v) in x[r * k..(r + 1) * k].iter().enumerate() {
                data[(p * k + kk) * NR + j] = *v;
            }
        }
        Panels { n, k, data }
    }

    /// Panels of the transpose of `x` (`k x n` row-major): output `j` takes column `j` of `x`.
    pub(crate) fn from_f32_transposed(x: &[f32], k: usize, n: usize) -> Panels {
        let n_panels = n.div_ceil(NR);
        let mut data = vec![0f32; n_panels * k * NR];
        for kk in 0..k {
            for p in 0..n_panels {
                let w = NR.min(n - p * NR);
                data[(p * k + kk) * NR..(p * k + kk) * NR + w]
                    .copy_from_slice(&x[kk * n + p * NR..kk * n + p * NR + w]);
            }
        }
        Panels { n, k, data }
    }
}

#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint elements.
unsafe impl Send for SharedOut {}
// SAFETY: tasks write disjoint elements.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// `x` (rows of `k`) rounded as ggml rounds activations for weights of `ty`, rows spread over
/// the pool.
/// The rounding [`round_for`] applies, in place, on the calling thread.
pub(crate) fn round_in_place(ty: GgmlType, x: &mut [f32]) {
    match ty {
        GgmlType::F16 => x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32()),
        GgmlType::BF16 => x.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
        _ => {}
    }
}

pub(crate) fn round_for(ty: GgmlType, x: &[f32], k: usize, pool: &ThreadPool) -> Option<Vec<f32>> {
    let round: fn(f32) -> f32 = match ty {
        GgmlType::F16 => |v| f16::from_f32(v).to_f32(),
        GgmlType::BF16 => |v| bf16::from_f32(v).to_f32(),
        _ => return None,
    };
    let mut out = x.to_vec();
    crate::ops::par_rows(pool, &mut out, k, |_, row| {
        for v in row {
            *v = round(*v);
        }
    });
    Some(out)
}

/// `out[i*n + j] = a[i] . W[j]` for `m` rows of `a` (`k` each).
pub(crate) fn gemm(a: &[f32], m: usize, w: &Panels, out: &mut [f32], pool: &ThreadPool) {
    let (n, k) = (w.n, w.k);
    debug_assert!(a.len() >= m * k && out.len() >= m * n);
    let n_panels = n.div_ceil(NR);
    let m_blocks = m.div_ceil(MR);
    // Tasks: a few panels by a band of rows, enough of them to balance the threads.
    let row_band = (m_blocks.div_ceil(8)).max(1) * MR;
    let n_bands = m.div_ceil(row_band);
    let panels_per_task = 4;
    let n_groups = n_panels.div_ceil(panels_per_task);
    let sink = SharedOut(out.as_mut_ptr());
    let kernel = Kernel::detect();
    pool.run(n_groups * n_bands, |t, _| {
        let (g, band) = (t % n_groups, t / n_groups);
        let rows = band * row_band..((band + 1) * row_band).min(m);
        // A band's last block of fewer than MR rows goes through the same kernel, its rows
        // copied into a zero-padded block (the padding's outputs are dropped).
        let mut padded = Vec::new();
        for p in g * panels_per_task..((g + 1) * panels_per_task).min(n_panels) {
            let panel = &w.data[p * k * NR..(p + 1) * k * NR];
            let width = NR.min(n - p * NR);
            let mut i = rows.start;
            while i < rows.end {
                let mr = MR.min(rows.end - i);
                let block = if mr == MR {
                    &a[i * k..(i + MR) * k]
                } else {
                    padded.resize(MR * k, 0.0);
                    padded[..mr * k].copy_from_slice(&a[i * k..(i + mr) * k]);
                    padded[mr * k..].fill(0.0);
                    &padded[..]
                };
                let mut acc = [[0f32; NR]; MR];
                kernel.run(block, k, panel, &mut acc);
                for (r, acc_row) in acc.iter().enumerate().take(mr) {
                    for (j, v) in acc_row.iter().enumerate().take(width) {
                        // SAFETY: (i + r, p*NR + j) is inside `out`; only this task owns it.
                        unsafe { *sink.at((i + r) * n + p * NR + j) = *v };
                    }
                }
                i += mr;
            }
        }
    });
}

/// The block kernel the CPU runs. Every kernel sums each output over `k` in order with fused
/// multiply-adds, so all give the same bits (tested); they differ in vector width only.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Kernel {
    fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                return Kernel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// `acc[r][j] = a[r] . panel[.., j]` for the MR rows of `a` (`k` each).
    fn run(self, a: &[f32], k: usize, panel: &[f32], acc: &mut [[f32; NR]; MR]) {
        assert!(a.len() >= MR * k && panel.len() >= k * NR);
        match self {
            // SAFETY: detected AVX-512F and FMA; the lengths are checked above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { kernel_avx512(a, k, panel, acc) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                for half in 0..2 {
                    // SAFETY: detected AVX2 and FMA; the lengths are checked above.
                    unsafe { kernel_avx2_half(a, k, panel, half * NR / 2, acc) };
                }
            }
            Kernel::Portable => kernel_portable(a, MR, k, panel, acc),
        }
    }
}

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn kernel_portable(a: &[f32], mr: usize, k: usize, panel: &[f32], acc: &mut [[f32; NR]; MR]) {
    for kk in 0..k {
        let b = &panel[kk * NR..(kk + 1) * NR];
        for r in 0..mr {
            let av = a[r * k + kk];
            for (c, bv) in acc[r].iter_mut().zip(b) {
                *c = av.mul_add(*bv, *c);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn kernel_avx512(a: &[f32], k: usize, panel: &[f32], acc: &mut [[f32; NR]; MR]) {
    // SAFETY: the caller guarantees AVX-512F and FMA; `a` holds MR rows of k and `panel` k * NR
    // floats, so every pointer offset and load below stays inside them.
    unsafe {
        use std::arch::x86_64::*;
        let (mut c00, mut c01, mut c10, mut c11, mut c20, mut c21) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        let (mut c30, mut c31, mut c40, mut c41, mut c50, mut c51) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        let (a0, a1, a2) = (a.as_ptr(), a.as_ptr().add(k), a.as_ptr().add(2 * k));
        let (a3, a4, a5) = (
            a.as_ptr().add(3 * k),
            a.as_ptr().add(4 * k),
            a.as_ptr().add(5 * k),
        );
        let mut pb = panel.as_ptr();
        for kk in 0..k {
            let b0 = _mm512_loadu_ps(pb);
            let b1 = _mm512_loadu_ps(pb.add(16));
            pb = pb.add(NR);
            let v = _mm512_set1_ps(*a0.add(kk));
            c00 = _mm512_fmadd_ps(v, b0, c00);
            c01 = _mm512_fmadd_ps(v, b1, c01);
            let v = _mm512_set1_ps(*a1.add(kk));
            c10 = _mm512_fmadd_ps(v, b0, c10);
            c11 = _mm512_fmadd_ps(v, b1, c11);
            let v = _mm512_set1_ps(*a2.add(kk));
            c20 = _mm512_fmadd_ps(v, b0, c20);
            c21 = _mm512_fmadd_ps(v, b1, c21);
            let v = _mm512_set1_ps(*a3.add(kk));
            c30 = _mm512_fmadd_ps(v, b0, c30);
            c31 = _mm512_fmadd_ps(v, b1, c31);
            let v = _mm512_set1_ps(*a4.add(kk));
            c40 = _mm512_fmadd_ps(v, b0, c40);
            c41 = _mm512_fmadd_ps(v, b1, c41);
            let v = _mm512_set1_ps(*a5.add(kk));
            c50 = _mm512_fmadd_ps(v, b0, c50);
            c51 = _mm512_fmadd_ps(v, b1, c51);
        }
        let rows = [
            (c00, c01),
            (c10, c11),
            (c20, c21),
            (c30, c31),
            (c40, c41),
            (c50, c51),
        ];
        for (r, (lo, hi)) in rows.iter().enumerate() {
            _mm512_storeu_ps(acc[r].as_mut_ptr(), *lo);
            _mm512_storeu_ps(acc[r].as_mut_ptr().add(16), *hi);
        }
    }
}

/// Outputs `first..first + NR/2` of the panel for MR rows: twelve 256-bit accumulators (the
/// sixteen registers of AVX2 hold no more beside the two loads and the broadcast).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2_half(
    a: &[f32],
    k: usize,
    panel: &[f32],
    first: usize,
    acc: &mut [[f32; NR]; MR],
) {
    // SAFETY: the caller guarantees AVX2 and FMA; `a` holds MR rows of k and `panel` k * NR
    // floats, and `first + 16 <= NR`, so every pointer offset and load stays inside them.
    unsafe {
        use std::arch::x86_64::*;
        let mut c = [[_mm256_setzero_ps(); 2]; MR];
        let mut pb = panel.as_ptr().add(first);
        for kk in 0..k {
            let b0 = _mm256_loadu_ps(pb);
            let b1 = _mm256_loadu_ps(pb.add(8));
            pb = pb.add(NR);
            for (r, cr) in c.iter_mut().enumerate() {
                let v = _mm256_set1_ps(*a.as_ptr().add(r * k + kk));
                cr[0] = _mm256_fmadd_ps(v, b0, cr[0]);
                cr[1] = _mm256_fmadd_ps(v, b1, cr[1]);
            }
        }
        for (r, cr) in c.iter().enumerate() {
            _mm256_storeu_ps(acc[r].as_mut_ptr().add(first), cr[0]);
            _mm256_storeu_ps(acc[r].as_mut_ptr().add(first + 8), cr[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_times_rows_equal_the_plain_product() {
        let pool = ThreadPool::new(2);
        let (m, n, k) = (13, 45, 21);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 8.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 5 % 13) as f32 - 6.0) / 16.0)
            .collect();
        let mut out = vec![0f32; m * n];
        gemm(&a, m, &Panels::from_f32(&w, n, k), &mut out, &pool);
        let mut wt = vec![0f32; k * n];
        for r in 0..n {
            for c in 0..k {
                wt[c * n + r] = w[r * k + c];
            }
        }
        let mut out_t = vec![0f32; m * n];
        gemm(
            &a,
            m,
            &Panels::from_f32_transposed(&wt, k, n),
            &mut out_t,
            &pool,
        );
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|c| a[i * k + c] * w[j * k + c]).sum();
                assert!((out[i * n + j] - want).abs() < 1e-4, "({i},{j})");
                assert_eq!(out[i * n + j], out_t[i * n + j]);
            }
        }
    }

    /// Every kernel the machine can run gives the portable kernel's bits, whole blocks and
    /// padded tails alike.
    #[test]
    fn kernels_give_the_same_bits() {
        let k = 37;
        let a: Vec<f32> = (0..MR * k)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0)
            .collect();
        let panel: Vec<f32> = (0..k * NR)
            .map(|i| ((i * 7 % 31) as f32 - 15.0) / 11.0)
            .collect();
        let mut want = [[0f32; NR]; MR];
        Kernel::Portable.run(&a, k, &panel, &mut want);
        let mut kernels = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                kernels.push(Kernel::Avx2);
            } else {
                nextn_testdata::cpu_feature_missing("avx2", "the AVX2 gemm kernel");
            }
            if has_avx512() {
                kernels.push(Kernel::Avx512);
            } else {
                nextn_testdata::cpu_feature_missing("avx512", "the AVX-512 gemm kernel");
            }
        }
        for kernel in kernels {
            let mut got = [[0f32; NR]; MR];
            kernel.run(&a, k, &panel, &mut got);
            for r in 0..MR {
                for j in 0..NR {
                    assert_eq!(
                        got[r][j].to_bits(),
                        want[r][j].to_bits(),
                        "{kernel:?} ({r},{j})"
                    );
                }
            }
        }
    }
}
