//! Fused AVX2 kernels for the weight types of common model files (Q4_K, Q5_K, Q6_K,
//! Q8_0): each weight block is decoded in registers and multiplied against every
//! activation row of the pass at once, with no staging buffer. For one activation row
//! that removes the store and re-load of the decoded row, which dominated the staged
//! kernels; for several rows each block is still read and decoded only once.
//!
//! Numerics: per (weight row, activation row) the integer block sums are exact and the
//! f32 operations are exactly those of `dot_avx2::dot_k` / `dot_legacy` on the staged
//! row (same lanes, same order), so results equal the staged AVX2 kernels' bit for bit.
//! Each activation row owns its accumulators and runs the same operation sequence
//! whatever the row count `N`, so a row's result never depends on its batch.

// The row loops index several per-row arrays (pointers, accumulators) in step.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;
use std::ops::Range;

use super::super::act::ActRows;
use super::super::matrix::{OutSink, QMatrix};
use super::super::stage::Stage;
use super::super::tables::k4_scales_mins_packed;
use super::decode_legacy::f16_at;
use super::dot_avx2::hsum_ps;

/// Raw pointers to each activation row's quantized values, block scales and 16-sums.
struct ActPtrs<const N: usize> {
    x: [*const u8; N],
    d: [*const f32; N],
    bsums: [*const u8; N],
}

fn act_ptrs<const N: usize>(act: &ActRows) -> ActPtrs<N> {
    debug_assert!(act.n_rows == N);
    let rows: [_; N] = core::array::from_fn(|i| act.row(i));
    ActPtrs {
        x: core::array::from_fn(|i| rows[i].qs.as_ptr() as *const u8),
        d: core::array::from_fn(|i| rows[i].d.as_ptr()),
        bsums: core::array::from_fn(|i| rows[i].bsums.as_ptr() as *const u8),
    }
}

/// How far ahead of the block being multiplied the weight stream is prefetched. The rows
/// of a task are contiguous, so this runs on into the next row; prefetches never fault.
const PREFETCH_BYTES: usize = 1024;

/// Ask for the weight bytes `PREFETCH_BYTES` past `p`, a block's start: one core's
/// hardware prefetcher alone leaves the single-row kernels waiting on memory.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch_ahead(p: *const u8, block_bytes: usize) {
    let ahead = p.wrapping_add(PREFETCH_BYTES) as *const i8;
    _mm_prefetch::<_MM_HINT_T0>(ahead);
    if block_bytes > 64 {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128));
    }
    if block_bytes > 192 {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(192));
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// `Σ` over the i16 pairs of `maddubs(w, x)` weighted by the i16 `scales`, as i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_pairs(w: __m256i, x: *const u8, scales: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, load(x)), scales)
}

/// The i16 scale vector of 32-weight sub-block `c` (all lanes = lane `c` of `both`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_per32(both: __m256i, c: usize) -> __m256i {
    let pick = _mm256_set1_epi16((2 * c as i16) | ((2 * c as i16 + 1) << 8));
    _mm256_shuffle_epi8(both, pick)
}

/// The i16 scale vector of 32-weight chunk `c` made of two 16-weight sub-blocks: lane 2c
/// of `s16` in the low half, lane 2c+1 in the high half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_per16(s16: __m256i, c: usize) -> __m256i {
    #[rustfmt::skip]
    let split = _mm256_setr_epi8(
        0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
        2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
    );
    let pair = _mm256_permutevar8x32_epi32(s16, _mm256_set1_epi32(c as i32));
    _mm256_shuffle_epi8(pair, split)
}

/// Q4_K / Q5_K block header: `d`, `dmin`, the per-32 scales broadcast to both 128-bit
/// halves, and the per-16 min vector (each 32-weight min covers two 16-sums).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_header(blk: *const u8) -> (f32, f32, __m256i, __m256i) {
    let packed = core::slice::from_raw_parts(blk.add(4), 12);
    let (sc, mn) = k4_scales_mins_packed(packed);
    let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
    let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
    let mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
    (f16_at(blk), f16_at(blk.add(2)), scales, mins)
}

/// Per activation row of a K block with a separate min scale (Q4_K, Q5_K):
/// acc += d_w·d_a·Σ, then acc −= dmin_w·d_a·(bsums·mins).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish_k_scaled<const N: usize>(
    a: &ActPtrs<N>,
    b: usize,
    (d, dmin, mins): (f32, f32, __m256i),
    sumi: &[__m256i; N],
    acc: &mut [__m256; N],
) {
    for i in 0..N {
        let ad = *a.d[i].add(b);
        let m = _mm256_madd_epi16(load(a.bsums[i].add(32 * b)), mins);
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * ad), _mm256_cvtepi32_ps(sumi[i]), acc[i]);
        let dm = -(dmin * ad);
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dm), _mm256_cvtepi32_ps(m), acc[i]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_rows<const N: usize>(m: &QMatrix, rows: Range<usize>, act: &ActRows, out: &OutSink) {
    let nb = m.cols / 256;
    let a = act_ptrs::<N>(act);
    let m4 = _mm256_set1_epi8(0x0f);
    for r in rows {
        let w = m.row(r);
        debug_assert!(w.len() == 144 * nb);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = w.as_ptr().add(144 * b);
            prefetch_ahead(blk, 144);
            let (d, dmin, scales, mins) = k4_header(blk);
            let mut sumi = [_mm256_setzero_si256(); N];
            for j in 0..4 {
                let q = load(blk.add(16 + 32 * j));
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                let (s_lo, s_hi) = (scale_per32(scales, 2 * j), scale_per32(scales, 2 * j + 1));
                for i in 0..N {
                    let x = a.x[i].add(256 * b + 64 * j);
                    let p = _mm256_add_epi32(
                        scaled_pairs(lo, x, s_lo),
                        scaled_pairs(hi, x.add(32), s_hi),
                    );
                    sumi[i] = _mm256_add_epi32(sumi[i], p);
                }
            }
            finish_k_scaled(&a, b, (d, dmin, mins), &sumi, &mut acc);
        }
        for (i, v) in acc.iter().enumerate() {
            out.write(i, r, hsum_ps(*v));
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_rows<const N: usize>(m: &QMatrix, rows: Range<usize>, act: &ActRows, out: &OutSink) {
    let nb = m.cols / 256;
    let a = act_ptrs::<N>(act);
    let m4 = _mm256_set1_epi8(0x0f);
    let bit4 = _mm256_set1_epi8(0x10);
    for r in rows {
        let w = m.row(r);
        debug_assert!(w.len() == 176 * nb);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let blk = w.as_ptr().add(176 * b);
            prefetch_ahead(blk, 176);
            let (d, dmin, scales, mins) = k4_header(blk);
            let qh = load(blk.add(16));
            let mut sumi = [_mm256_setzero_si256(); N];
            for j in 0..4 {
                let q = load(blk.add(48 + 32 * j));
                let high = |s: usize| {
                    let bit = _mm256_set1_epi8(1i8 << s);
                    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), bit4)
                };
                let lo = _mm256_or_si256(_mm256_and_si256(q, m4), high(2 * j));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                    high(2 * j + 1),
                );
                let (s_lo, s_hi) = (scale_per32(scales, 2 * j), scale_per32(scales, 2 * j + 1));
                for i in 0..N {
                    let x = a.x[i].add(256 * b + 64 * j);
                    let p = _mm256_add_epi32(
                        scaled_pairs(lo, x, s_lo),
                        scaled_pairs(hi, x.add(32), s_hi),
                    );
                    sumi[i] = _mm256_add_epi32(sumi[i], p);
                }
            }
            finish_k_scaled(&a, b, (d, dmin, mins), &sumi, &mut acc);
        }
        for (i, v) in acc.iter().enumerate() {
            out.write(i, r, hsum_ps(*v));
        }
    }
}

/// Q6_K: weights unsigned 0..63 (true value + 32); the offset is subtracted exactly in
/// integers through the activation 16-sums times 32·scale.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_rows<const N: usize>(m: &QMatrix, rows: Range<usize>, act: &ActRows, out: &OutSink) {
    let nb = m.cols / 256;
    let a = act_ptrs::<N>(act);
    let m4 = _mm256_set1_epi8(0x0f);
    let m2h = _mm256_set1_epi8(0x30);
    for r in rows {
        let w = m.row(r);
        debug_assert!(w.len() == 210 * nb);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let p = w.as_ptr().add(210 * b);
            prefetch_ahead(p, 210);
            let d = f16_at(p.add(208));
            let s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
            let mut sumi = [_mm256_setzero_si256(); N];
            for n in 0..2 {
                let lo_a = load(p.add(64 * n));
                let lo_b = load(p.add(64 * n + 32));
                let h = load(p.add(128 + 32 * n));
                // Two high bits 2c..2c+2 of h moved to bits 4..6 (16-bit shifts; the mask
                // drops what crosses byte borders).
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(lo_a, m4),
                        _mm256_and_si256(_mm256_slli_epi16(h, 4), m2h),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(lo_b, m4),
                        _mm256_and_si256(_mm256_slli_epi16(h, 2), m2h),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(lo_a, 4), m4),
                        _mm256_and_si256(h, m2h),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(lo_b, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(h, 2), m2h),
                    ),
                ];
                for (k, qk) in q.into_iter().enumerate() {
                    let c = 4 * n + k;
                    let sc = scale_per16(s16, c);
                    for i in 0..N {
                        let x = a.x[i].add(256 * b + 32 * c);
                        sumi[i] = _mm256_add_epi32(sumi[i], scaled_pairs(qk, x, sc));
                    }
                }
            }
            let mins = _mm256_slli_epi16(s16, 5);
            for i in 0..N {
                let ad = *a.d[i].add(b);
                let off = _mm256_madd_epi16(load(a.bsums[i].add(32 * b)), mins);
                let total = _mm256_sub_epi32(sumi[i], off);
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * ad), _mm256_cvtepi32_ps(total), acc[i]);
            }
        }
        for (i, v) in acc.iter().enumerate() {
            out.write(i, r, hsum_ps(*v));
        }
    }
}

/// Q8_0 against Q8_0 activations: |w|·sign(x, w) pairs; even and odd blocks feed separate
/// accumulators (as `dot_legacy` does) to hide the FMA latency.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_rows<const N: usize>(m: &QMatrix, rows: Range<usize>, act: &ActRows, out: &OutSink) {
    let nb = m.cols / 32;
    let a = act_ptrs::<N>(act);
    for r in rows {
        let w = m.row(r);
        debug_assert!(w.len() == 34 * nb);
        // Even blocks accumulate into `acc0`, odd ones into `acc1`; indexing one array by
        // parity would keep the accumulators in memory.
        let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
        let mut b = 0;
        while b + 2 <= nb {
            q8_0_block(w.as_ptr(), &a, b, &mut acc0);
            q8_0_block(w.as_ptr(), &a, b + 1, &mut acc1);
            b += 2;
        }
        if b < nb {
            q8_0_block(w.as_ptr(), &a, b, &mut acc0);
        }
        for i in 0..N {
            out.write(i, r, hsum_ps(_mm256_add_ps(acc0[i], acc1[i])));
        }
    }
}

/// Block `b` of a Q8_0 row at `w` against every activation row: acc += d_w·d_a·Σ(w·x).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_block<const N: usize>(
    w: *const u8,
    a: &ActPtrs<N>,
    b: usize,
    acc: &mut [__m256; N],
) {
    let p = w.add(34 * b);
    prefetch_ahead(p, 34);
    let d = f16_at(p);
    let q = load(p.add(2));
    let qabs = _mm256_abs_epi8(q);
    for i in 0..N {
        let x = load(a.x[i].add(32 * b));
        let pairs = _mm256_maddubs_epi16(qabs, _mm256_sign_epi8(x, q));
        let sum = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        let s = _mm256_set1_ps(d * *a.d[i].add(b));
        acc[i] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sum), acc[i]);
    }
}

/// Defines `$name`, a `RowsFn` that runs `$kernel::<N>` for the pass's row count.
macro_rules! by_row_count {
    ($name:ident, $kernel:ident) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $name(
            m: &QMatrix,
            rows: Range<usize>,
            act: &ActRows,
            _stage: &mut Stage,
            out: &OutSink,
        ) {
            match act.n_rows {
                0 => {}
                1 => $kernel::<1>(m, rows, act, out),
                2 => $kernel::<2>(m, rows, act, out),
                3 => $kernel::<3>(m, rows, act, out),
                4 => $kernel::<4>(m, rows, act, out),
                5 => $kernel::<5>(m, rows, act, out),
                6 => $kernel::<6>(m, rows, act, out),
                7 => $kernel::<7>(m, rows, act, out),
                8 => $kernel::<8>(m, rows, act, out),
                n => unreachable!("{n} activation rows in one pass (at most 8)"),
            }
        }
    };
}

by_row_count!(rows_q4_k, q4_k_rows);
by_row_count!(rows_q5_k, q5_k_rows);
by_row_count!(rows_q6_k, q6_k_rows);
by_row_count!(rows_q8_0, q8_0_rows);
