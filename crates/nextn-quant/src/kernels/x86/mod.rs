//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL).
//!
//! Per weight row: one decoder unpacks it into a `DecodedRow`, then one dot function runs per
//! activation row. Decoders are AVX2 code that the AVX-512 kernels reuse (decoding is a
//! small share of the work); the dot products have a version per level. At both levels
//! the common model types (Q4_K, Q5_K, Q6_K, Q8_0) use the fused kernels of `fused`
//! instead, which need no decoded row, and on CPUs with VNNI (Q4_K, Q6_K, Q8_0) those of
//! `fused_vnni`, which give the same bits with half the integer multiplies per row.

pub(crate) mod act_avx2;
mod decode_k;
mod decode_legacy;
mod dot_avx2;
mod dot_avx512;
mod fused;
mod fused_vnni;

use std::ops::Range;

use super::act::ActRows;
use super::decoded_row::DecodedRow;
use super::matrix::{Layout, OutSink, QMatrix, RowsFn};
use super::simd::SimdLevel;
use crate::GgmlType;
use decode_k::*;
use decode_legacy::*;
use dot_avx2::{MINS_NONE, MINS_OFFSET, MINS_SCALED};

/// Defines `$name`: for each weight row, `$decode` it into a `DecodedRow`, then `$dot` it with
/// every activation row. `$feat` must cover what `$decode` and `$dot` are compiled for.
macro_rules! rows_kernel {
    ($name:ident, $feat:literal, $decode:expr, $dot:expr) => {
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $name(
            m: &QMatrix,
            rows: Range<usize>,
            act: &ActRows,
            st: &mut DecodedRow,
            out: &OutSink,
        ) {
            // SAFETY: the CPU has this kernel's features (`$feat`) (this runs only under kernels
            // compiled for them, which the dispatcher chose after checking the CPU); `rows` lie
            // inside the matrix `m` (validated by `QMatrix::new`), `act` is quantized for its type
            // and width, `st` was made for them, and `out` holds every (activation, row) written,
            // which no other thread writes.
            unsafe {
                let nb = m.cols / m.ty.block_size();
                for r in rows {
                    let w = m.row(r);
                    ($decode)(w, st, nb);
                    for i in 0..act.n_rows {
                        let a = act.row(i);
                        out.write(i, r, ($dot)(w, &*st, &a, nb));
                    }
                }
            }
        }
    };
}

/// One AVX2 and one AVX-512 kernel per type, and the lookup from type to kernel.
macro_rules! kernels {
    ($( $ty:ident => $decode:ident, $dot2:expr, $dot512:expr; )*) => {
        #[allow(non_snake_case)]
        mod avx2_kernels {
            use super::*;
            $( rows_kernel!($ty, "avx2,fma,f16c", $decode, $dot2); )*
        }
        #[allow(non_snake_case)]
        mod avx512_kernels {
            use super::*;
            $( rows_kernel!($ty, "avx512f,avx512bw,avx512vl,avx2,fma,f16c", $decode, $dot512); )*
        }

        /// The staged kernel for `ty` at `level` (Avx2 or Avx512; the caller has checked
        /// that the CPU supports it and that `ty` is supported).
        #[allow(non_snake_case)]
        fn staged_rows_fn(level: SimdLevel, ty: GgmlType) -> RowsFn {
            let wide = level == SimdLevel::Avx512;
            match ty {
                $( GgmlType::$ty => if wide { avx512_kernels::$ty as RowsFn } else { avx2_kernels::$ty as RowsFn }, )*
                _ => unreachable!("no x86 kernel for {ty}"),
            }
        }
    };
}

use dot_avx2 as d2;
use dot_avx512 as d5;

// F32, F16 and BF16 rows are summed in the AVX2 kernel's lane order at the AVX-512 level too:
// that is ggml's order for these types on AVX2, so F32 files give llama.cpp's goldens to float
// rounding and the same bits on either kind of x86 machine (16-lane sums moved a tied 248k-row
// head's logits by 0.05 against them). These products are rare in real models (norm-sized
// tensors; F16/BF16 files are memory bound either way).
kernels! {
    F32 => decode_none, d2::dot_f32_row, d2::dot_f32_row;
    F16 => decode_f16, d2::dot_f32_staged, d2::dot_f32_staged;
    BF16 => decode_bf16, d2::dot_f32_staged, d2::dot_f32_staged;
    Q4_0 => decode_q4_0, d2::dot_legacy::<false, false, 8>, d5::dot_legacy::<false, false, 8>;
    Q4_1 => decode_q4_1, d2::dot_legacy::<false, true, 0>, d5::dot_legacy::<false, true, 0>;
    Q5_0 => decode_q5_0, d2::dot_legacy::<false, false, 16>, d5::dot_legacy::<false, false, 16>;
    Q5_1 => decode_q5_1, d2::dot_legacy::<false, true, 0>, d5::dot_legacy::<false, true, 0>;
    Q8_0 => decode_q8_0, d2::dot_legacy::<true, false, 0>, d5::dot_legacy::<true, false, 0>;
    IQ4_NL => decode_iq4_nl, d2::dot_legacy::<true, false, 0>, d5::dot_legacy::<true, false, 0>;
    MXFP4 => decode_mxfp4, d2::dot_legacy::<false, false, MXFP4_OFFSET>, d5::dot_legacy::<false, false, MXFP4_OFFSET>;
    Q2_K => decode_q2_k, d2::dot_k::<false, MINS_SCALED>, d5::dot_k::<false, MINS_SCALED>;
    Q3_K => decode_q3_k, d2::dot_k::<false, MINS_OFFSET>, d5::dot_k::<false, MINS_OFFSET>;
    Q4_K => decode_q4_k, d2::dot_k::<false, MINS_SCALED>, d5::dot_k::<false, MINS_SCALED>;
    Q5_K => decode_q5_k, d2::dot_k::<false, MINS_SCALED>, d5::dot_k::<false, MINS_SCALED>;
    Q6_K => decode_q6_k, d2::dot_k::<false, MINS_OFFSET>, d5::dot_k::<false, MINS_OFFSET>;
    Q8_K => decode_q8_k, d2::dot_k::<true, MINS_NONE>, d5::dot_k::<true, MINS_NONE>;
    IQ4_XS => decode_iq4_xs, d2::dot_k::<true, MINS_NONE>, d5::dot_k::<true, MINS_NONE>;
}

/// The kernel for `ty` at `level` (Avx2 or Avx512; the caller has checked that the CPU
/// supports it and that `ty` is supported). Q4_K, Q6_K and Q8_0 take the VNNI kernels where
/// the CPU has VNNI at that level (AVX512-VNNI at the AVX-512 level; AVX-VNNI on CPUs
/// without AVX-512), else, like Q5_K, the fused AVX2 kernels — also at the AVX-512 level,
/// since the staged kernels pay a store and re-load of every decoded weight row (1.9× the
/// fused kernel's time for one activation row, measured on AVX2). Other types take the
/// staged kernel of the level. All of these give the same results for Q4_K, Q5_K, Q6_K and
/// Q8_0 at either level, bit for bit.
pub(crate) fn rows_fn(level: SimdLevel, ty: GgmlType, layout: Layout) -> RowsFn {
    if layout == Layout::Repacked {
        // The caller checked that `ty` has a repacked kernel at this level.
        if let Some(f) = vnni_rows_fn(level, ty, layout) {
            return f;
        }
        return match ty {
            GgmlType::Q4_K => fused::rows_q4_k_packed,
            GgmlType::Q6_K => fused::rows_q6_k_packed,
            _ => unreachable!("no repacked kernel for {ty}"),
        };
    }
    if let Some(f) = vnni_rows_fn(level, ty, layout) {
        return f;
    }
    match ty {
        GgmlType::Q4_K => fused::rows_q4_k,
        GgmlType::Q5_K => fused::rows_q5_k,
        GgmlType::Q6_K => fused::rows_q6_k,
        GgmlType::Q8_0 => fused::rows_q8_0,
        _ => staged_rows_fn(level, ty),
    }
}

/// The VNNI kernel for `ty` at `level`, if the CPU and the type have one. A CPU with AVX-512
/// run at the AVX2 level (`NEXTN_SIMD=avx2`) gets plain AVX2.
fn vnni_rows_fn(level: SimdLevel, ty: GgmlType, layout: Layout) -> Option<RowsFn> {
    use fused_vnni::Vnni;
    let vnni = fused_vnni::detected_vnni()?;
    let allowed = match level {
        SimdLevel::Avx512 => true,
        SimdLevel::Avx2 => vnni == Vnni::Avx && !SimdLevel::Avx512.is_supported(),
        _ => false,
    };
    match (allowed, layout) {
        (false, _) => None,
        (true, Layout::Ggml) => fused_vnni::rows_fn(vnni, ty),
        (true, Layout::Repacked) => fused_vnni::packed_rows_fn(vnni, ty),
    }
}

/// `data` (whole blocks of `ty`) in [`Layout::Repacked`], for the types that have it.
pub(crate) fn repack(ty: GgmlType, data: &[u8]) -> Option<Vec<u8>> {
    if !SimdLevel::Avx2.is_supported() {
        return None;
    }
    let f: unsafe fn(&[u8], &mut [u8]) = match ty {
        GgmlType::Q4_K => fused::repack_q4_k,
        GgmlType::Q6_K => fused::repack_q6_k,
        _ => return None,
    };
    let mut out = vec![0u8; data.len()];
    // Big matrices are split over the cores in whole blocks: loading a large model repacks
    // gigabytes.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let blocks = data.len() / ty.type_size();
    let per = blocks.div_ceil(threads).max(1 << 14) * ty.type_size();
    std::thread::scope(|scope| {
        for (src, dst) in data.chunks(per).zip(out.chunks_mut(per)) {
            // SAFETY: AVX2 checked above; `src` and `dst` hold the same whole number of
            // blocks (the caller checked `data`; `per` is a multiple of the block size).
            scope.spawn(move || unsafe { f(src, dst) });
        }
    });
    Some(out)
}

/// The instruction set the matrix kernels run at `level`, for reports: the level's name,
/// with "+vnni" where the VNNI kernels run (for Q4_K, Q6_K and Q8_0).
pub(crate) fn kernel_isa(level: SimdLevel) -> String {
    match vnni_rows_fn(level, GgmlType::Q4_K, Layout::Ggml) {
        Some(_) => format!("{level}+vnni"),
        None => level.name().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::act::{ActKind, ActRows};
    use super::super::matrix::repack;
    use super::*;

    /// xorshift64*: deterministic test data without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// Random blocks of `ty` whose f16 scale fields (at `fields` in each block) are modest.
    fn random_matrix(ty: GgmlType, rows: usize, cols: usize, fields: &[usize]) -> Vec<u8> {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ty.type_size() as u64);
        let n_bytes = rows * cols / ty.block_size() * ty.type_size();
        let mut data: Vec<u8> = (0..n_bytes).map(|_| rng.next() as u8).collect();
        for blk in data.chunks_exact_mut(ty.type_size()) {
            for &at in fields {
                let v = half::f16::from_f32(0.02 * rng.uniform()).to_bits();
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        data
    }

    /// `random_matrix` with every quant of the first row at its largest magnitude (Q4_K 15,
    /// Q6_K 63, Q8_0 −128): the bounds the kernels' integer sums rely on.
    fn random_matrix_extreme_first_row(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        fields: &[usize],
    ) -> Vec<u8> {
        let mut data = random_matrix(ty, rows, cols, fields);
        let blocks = cols / ty.block_size();
        for blk in data.chunks_exact_mut(ty.type_size()).take(blocks) {
            match ty {
                GgmlType::Q4_K => blk[16..].fill(0xff),
                GgmlType::Q6_K => blk[..192].fill(0xff),
                _ => blk[2..].fill(0x80),
            }
        }
        data
    }

    fn run(f: RowsFn, m: &QMatrix, act: &ActRows) -> Vec<u32> {
        let mut out = vec![0f32; m.rows * act.n_rows];
        let sink = OutSink::new(&mut out, m.rows, act.n_rows);
        let mut decoded = DecodedRow::new(m.ty, m.cols);
        // SAFETY: AVX2 checked by the caller, matrix validated by `QMatrix::new`, `act`
        // quantized for this type and width, the decoded row made for them.
        unsafe { f(m, 0..m.rows, act, &mut decoded, &sink) };
        out.iter().map(|v| v.to_bits()).collect()
    }

    /// The VNNI kernels give the fused AVX2 kernels' results bit for bit, for every row
    /// count: their arithmetic with the VNNI instructions emulated in AVX2 always, and with
    /// the real instructions where the CPU has them.
    #[test]
    fn vnni_kernels_match_fused_bit_for_bit() {
        if !SimdLevel::Avx2.is_supported() {
            nextn_testdata::cpu_feature_missing("avx2", "the VNNI kernels");
            return;
        }
        let detected = fused_vnni::detected_vnni();
        if detected.is_none() {
            nextn_testdata::cpu_feature_missing(
                "vnni",
                "the VNNI kernels on the hardware instructions (the emulated ones are checked)",
            );
        }
        // Extreme activations (±127, −128 after rounding) and the largest quants exercise
        // the i16 bounds the VNNI kernels rely on.
        let cases: [(GgmlType, usize, &[usize]); 3] = [
            (GgmlType::Q4_K, 768, &[0, 2]),
            (GgmlType::Q6_K, 768, &[208]),
            (GgmlType::Q8_0, 800, &[0]),
        ];
        let rows = 19;
        for (ty, cols, fields) in cases {
            let data = random_matrix_extreme_first_row(ty, rows, cols, fields);
            let m = QMatrix::new(ty, rows, cols, &data).unwrap();
            let kind = ActKind::for_weight(ty).unwrap();
            let fused_fn = match ty {
                GgmlType::Q4_K => fused::rows_q4_k as RowsFn,
                GgmlType::Q6_K => fused::rows_q6_k,
                _ => fused::rows_q8_0,
            };
            let mut variants = vec![("emulated", fused_vnni::emulated_rows_fn(ty).unwrap())];
            if let Some(v) = detected {
                variants.push(("hardware", fused_vnni::rows_fn(v, ty).unwrap()));
            }
            let mut rng = Rng(91);
            for n in 1..=8 {
                let mut x: Vec<f32> = (0..n * cols).map(|_| 3.0 * rng.uniform()).collect();
                // Row 0 at the extremes: one large value sets the block scale, the rest sit
                // at ±max of the range.
                for (k, v) in x[..cols].iter_mut().enumerate() {
                    *v = if k % 2 == 0 { -3.0 } else { 3.0 };
                }
                let act = ActRows::quantize(kind, &x, n, cols, true);
                let want = run(fused_fn, &m, &act);
                for (name, f) in &variants {
                    assert_eq!(run(*f, &m, &act), want, "{ty} {name} VNNI with {n} rows");
                }
            }
        }
    }

    /// Repacked Q4_K / Q6_K matrices give the ggml-layout fused kernels' results bit for bit,
    /// with the AVX2 kernels, the emulated VNNI ones and (where the CPU has them) the real
    /// VNNI ones; through `QMatrix` too, which refuses them at a level without such kernels.
    #[test]
    fn repacked_kernels_match_bit_for_bit() {
        if !SimdLevel::Avx2.is_supported() {
            nextn_testdata::cpu_feature_missing("avx2", "the repacked AVX2 kernels");
            return;
        }
        let cases: [(GgmlType, usize, &[usize]); 2] = [
            (GgmlType::Q4_K, 768, &[0, 2]),
            (GgmlType::Q6_K, 1024, &[208]),
        ];
        let rows = 23;
        for (ty, cols, fields) in cases {
            let data = random_matrix_extreme_first_row(ty, rows, cols, fields);
            let packed = repack(ty, &data).expect("repack");
            assert_ne!(packed, data, "{ty}: repacking changed nothing");
            let m = QMatrix::new(ty, rows, cols, &data).unwrap();
            let mp = QMatrix {
                layout: Layout::Repacked,
                ..QMatrix::new(ty, rows, cols, &packed).unwrap()
            };
            let kind = ActKind::for_weight(ty).unwrap();
            let mut pairs = vec![(
                "avx2",
                rows_fn(SimdLevel::Avx2, ty, Layout::Ggml),
                match ty {
                    GgmlType::Q4_K => fused::rows_q4_k_packed as RowsFn,
                    _ => fused::rows_q6_k_packed,
                },
            )];
            pairs.push((
                "emulated vnni",
                fused_vnni::emulated_rows_fn(ty).unwrap(),
                fused_vnni::emulated_packed_rows_fn(ty).unwrap(),
            ));
            if let Some(v) = fused_vnni::detected_vnni() {
                pairs.push((
                    "vnni",
                    fused_vnni::rows_fn(v, ty).unwrap(),
                    fused_vnni::packed_rows_fn(v, ty).unwrap(),
                ));
            }
            let mut rng = Rng(5);
            for n in 1..=8 {
                let x: Vec<f32> = (0..n * cols).map(|_| 3.0 * rng.uniform()).collect();
                let act = ActRows::quantize(kind, &x, n, cols, true);
                for (name, plain, repacked) in &pairs {
                    assert_eq!(
                        run(*repacked, &mp, &act),
                        run(*plain, &m, &act),
                        "{ty} {name} with {n} rows"
                    );
                }
                // The public path: same bits, and no product below the AVX2 level.
                let pool = crate::kernels::ThreadPool::new(2);
                let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                let mr = QMatrix::new_repacked(ty, rows, cols, &packed).unwrap();
                mr.mul_rows(&x, n, &mut a, &pool).unwrap();
                m.mul_rows(&x, n, &mut b, &pool).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{ty} mul_rows with {n} rows");
                assert!(mr
                    .mul_rows_with(SimdLevel::Scalar, &x, n, &mut a, &pool)
                    .is_err());
                assert!(mr.mul_rows_reference(&x, n, &mut a).is_err());
            }
        }
        assert!(repack(GgmlType::Q8_0, &[0u8; 34]).is_none());
    }

    /// The fused kernels compute exactly what the staged ones do, for every row count
    /// (including odd block counts, which take the Q8_0 kernel's tail path) — except Q4_K
    /// and Q6_K, whose fused kernels group the exact integer sums into different f32 lanes
    /// (see `fused::q4_k_rows`): they must agree to f32 rounding, and with themselves at
    /// every row count.
    /// Lane r of `hsum_ps_x8` is `hsum_ps(v[r])` bit for bit, on lanes of mixed magnitudes
    /// where any other order of the adds rounds differently.
    #[test]
    fn hsum_of_eight_registers_matches_one_at_a_time() {
        if !SimdLevel::Avx2.is_supported() {
            nextn_testdata::cpu_feature_missing("avx2", "the AVX2 horizontal sums");
            return;
        }
        let mut rng = Rng(5);
        for _ in 0..200 {
            let lanes: [[f32; 8]; 8] = core::array::from_fn(|_| {
                core::array::from_fn(|_| {
                    let scale = [1e-3f32, 1.0, 3e4][(rng.next() % 3) as usize];
                    scale * (rng.uniform() - 0.5)
                })
            });
            // SAFETY: AVX2 is present (checked above); the loads read 8 floats each.
            let (all, each) = unsafe {
                use core::arch::x86_64::*;
                let v: [__m256; 8] = core::array::from_fn(|r| _mm256_loadu_ps(lanes[r].as_ptr()));
                let mut all = [0f32; 8];
                _mm256_storeu_ps(all.as_mut_ptr(), dot_avx2::hsum_ps_x8(&v));
                let each: [f32; 8] = core::array::from_fn(|r| dot_avx2::hsum_ps(v[r]));
                (all, each)
            };
            assert_eq!(all.map(f32::to_bits), each.map(f32::to_bits), "{lanes:?}");
        }
    }

    #[test]
    fn fused_kernels_match_staged_bit_for_bit() {
        if !SimdLevel::Avx2.is_supported() {
            nextn_testdata::cpu_feature_missing("avx2", "the fused AVX2 kernels");
            return;
        }
        let cases: [(GgmlType, usize, &[usize]); 4] = [
            (GgmlType::Q4_K, 768, &[0, 2]),
            (GgmlType::Q5_K, 768, &[0, 2]),
            (GgmlType::Q6_K, 768, &[208]),
            (GgmlType::Q8_0, 800, &[0]),
        ];
        let rows = 21;
        for (ty, cols, fields) in cases {
            let data = random_matrix(ty, rows, cols, fields);
            let m = QMatrix::new(ty, rows, cols, &data).unwrap();
            let kind = ActKind::for_weight(ty).unwrap();
            let fused_fn = match ty {
                GgmlType::Q4_K => fused::rows_q4_k as RowsFn,
                GgmlType::Q5_K => fused::rows_q5_k,
                GgmlType::Q6_K => fused::rows_q6_k,
                _ => fused::rows_q8_0,
            };
            let staged_fn = staged_rows_fn(SimdLevel::Avx2, ty);
            assert_ne!(
                fused_fn as usize, staged_fn as usize,
                "{ty} has no fused kernel"
            );
            let mut rng = Rng(77);
            for n in 1..=8 {
                let x: Vec<f32> = (0..n * cols).map(|_| 3.0 * rng.uniform()).collect();
                let act = ActRows::quantize(kind, &x, n, cols, true);
                let fused = run(fused_fn, &m, &act);
                let staged = run(staged_fn, &m, &act);
                if !matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) {
                    assert_eq!(fused, staged, "{ty} with {n} activation rows");
                    continue;
                }
                for (k, (f, s)) in fused.iter().zip(&staged).enumerate() {
                    let (f, s) = (f32::from_bits(*f), f32::from_bits(*s));
                    assert!(
                        (f - s).abs() <= 2e-4 * s.abs().max(1.0),
                        "{ty} with {n} rows, output {k}: fused {f} staged {s}"
                    );
                }
                // Row i alone gives the bits it got in the batch.
                for i in 0..n {
                    let one = ActRows::quantize(kind, &x[i * cols..(i + 1) * cols], 1, cols, true);
                    let alone = run(fused_fn, &m, &one);
                    for r in 0..rows {
                        assert_eq!(
                            alone[r],
                            fused[i * rows + r],
                            "{ty}: row {i} of {n}, output {r}"
                        );
                    }
                }
            }
        }
    }
}
