//! Fused AVX2 kernels for the weight types of common model files (Q4_K, Q5_K, Q6_K,
//! Q8_0): each weight block is decoded in registers and multiplied against every
//! activation row of the pass at once, with no staging buffer. For one activation row
//! that removes the store and re-load of the decoded row, which dominated the staged
//! kernels; for several rows each block is still read and decoded only once.
//!
//! Numerics: per (weight row, activation row) the integer block sums are exact. For Q5_K and
//! Q8_0 the f32 operations are exactly those of `dot_avx2::dot_k` / `dot_legacy` on the staged
//! row (same lanes, same order), so results equal the staged AVX2 kernels' bit for bit. Q4_K
//! and Q6_K regroup the exact integer sums across the eight i32 lanes (to share scale
//! multiplies between sub-blocks; see `q4_k_rows`), so they agree with the staged kernels to
//! f32 rounding. Either way each activation row owns its accumulators and runs the same
//! operation sequence whatever the row count `N`, so a row's result never depends on its batch.

// The row loops index several per-row arrays (pointers, accumulators) in step.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;
use std::ops::Range;

use super::super::act::ActRows;
use super::super::decoded_row::DecodedRow;
use super::super::matrix::{OutSink, QMatrix};
use super::super::tables::k4_scales_mins_packed;
use super::decode_legacy::f16_at;
use super::dot_avx2::{hsum_ps, hsum_ps_x8};

/// Raw pointers to each activation row's quantized values, block scales and 16-sums.
pub(super) struct ActPtrs<const N: usize> {
    pub(super) x: [*const u8; N],
    pub(super) d: [*const f32; N],
    pub(super) bsums: [*const u8; N],
}

pub(super) fn act_ptrs<const N: usize>(act: &ActRows) -> ActPtrs<N> {
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
pub(super) unsafe fn prefetch_ahead(p: *const u8, block_bytes: usize) {
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
pub(super) unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `p` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// `Σ` over the i16 pairs of `maddubs(w, x)` weighted by the i16 `scales`, as i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_pairs(w: __m256i, x: *const u8, scales: __m256i) -> __m256i {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `x` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, load(x)), scales) }
}

/// The i16 scale vector of 32-weight sub-block `c` (all lanes = lane `c` of `both`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_per32(both: __m256i, c: usize) -> __m256i {
    let pick = _mm256_set1_epi16((2 * c as i16) | ((2 * c as i16 + 1) << 8));
    _mm256_shuffle_epi8(both, pick)
}

/// Q4_K / Q5_K block header: `d`, `dmin`, the per-32 scales broadcast to both 128-bit
/// halves, and the per-16 min vector (each 32-weight min covers two 16-sums).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k4_header(blk: *const u8) -> (f32, f32, __m256i, __m256i) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `blk` points at (or is) one whole block of the
    // type, so the header bytes read lie inside it.
    unsafe {
        let packed = core::slice::from_raw_parts(blk.add(4), 12);
        let (sc, mn) = k4_scales_mins_packed(packed);
        let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
        let mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
        (f16_at(blk), f16_at(blk.add(2)), scales, mins)
    }
}

/// Per activation row of a K block with a separate min scale (Q4_K, Q5_K):
/// acc += d_w·d_a·Σ, then acc −= dmin_w·d_a·(bsums·mins).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn finish_k_scaled<const N: usize>(
    a: &ActPtrs<N>,
    b: usize,
    (d, dmin, mins): (f32, f32, __m256i),
    sumi: &[__m256i; N],
    acc: &mut [__m256; N],
) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); the pointers in `a` cover whole activation rows
    // of the matrix's width, so block `b` lies inside them.
    unsafe {
        for i in 0..N {
            let ad = *a.d[i].add(b);
            let m = _mm256_madd_epi16(load(a.bsums[i].add(32 * b)), mins);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * ad), _mm256_cvtepi32_ps(sumi[i]), acc[i]);
            let dm = -(dmin * ad);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dm), _mm256_cvtepi32_ps(m), acc[i]);
        }
    }
}

/// Q4_K with fewer multiplies per activation row. The four 32-byte quant chunks are
/// transposed by dwords within each 128-bit half, so that in each of the four resulting
/// vectors the low nibbles of dword m belong to sub-block σL(m) = [0,2,4,6,0,2,4,6][m] and the
/// high nibbles to σH(m) = σL(m)+1. Vectors with the same sub-block per lane can be summed in
/// i16 (4 × 2·15·127 < 2^15) before one scale multiply, so a row costs 8 `maddubs` + 2
/// scale `madd` + 1 min `madd` per block instead of 8 + 8 + 1 — the int-multiply pipe is what
/// bounds extra rows on CPUs with one. The activations are permuted the same way once per
/// call (`q4_k_permute_act`). Lane m of the block's integer sum holds sc·(partial sums) of
/// the sub-blocks σL(m), σH(m); its value, and the f32 steps after it, are the same for
/// every row count, so a row's result does not depend on its batch.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_rows<const N: usize, const PACKED: bool>(
    m: &QMatrix,
    rows: Range<usize>,
    act: &ActRows,
    out: &OutSink,
) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `rows` lie inside the matrix `m` (validated by
    // `QMatrix::new`), `act` is quantized for its type and width, and `out` holds every
    // (activation, row) written, which no other thread writes.
    unsafe {
        let nb = m.cols / 256;
        let a = act_ptrs::<N>(act);
        let permuted: [Vec<u8>; N] =
            core::array::from_fn(|i| q4_k_permute_act(core::slice::from_raw_parts(a.x[i], m.cols)));
        let xp: [*const u8; N] = core::array::from_fn(|i| permuted[i].as_ptr());
        #[rustfmt::skip]
    let (pick_l, pick_h) = (
        _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                         0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13),
        _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                         2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15),
    );
        for r in rows {
            let w = m.row(r);
            debug_assert!(w.len() == 144 * nb);
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..nb {
                let blk = w.as_ptr().add(144 * b);
                prefetch_ahead(blk, 144);
                let (d, dmin, scales, mins) = k4_header(blk);
                let (sc_l, sc_h) = (
                    _mm256_shuffle_epi8(scales, pick_l),
                    _mm256_shuffle_epi8(scales, pick_h),
                );
                let (lo, hi) = if PACKED {
                    q4_k_quants_packed(blk)
                } else {
                    q4_k_quants(blk)
                };
                let mut sumi = [_mm256_setzero_si256(); N];
                for i in 0..N {
                    let xb = xp[i].add(256 * b);
                    let mut sl = _mm256_maddubs_epi16(lo[0], load(xb));
                    let mut sh = _mm256_maddubs_epi16(hi[0], load(xb.add(32)));
                    for u in 1..4 {
                        sl =
                            _mm256_add_epi16(sl, _mm256_maddubs_epi16(lo[u], load(xb.add(64 * u))));
                        sh = _mm256_add_epi16(
                            sh,
                            _mm256_maddubs_epi16(hi[u], load(xb.add(64 * u + 32))),
                        );
                    }
                    sumi[i] =
                        _mm256_add_epi32(_mm256_madd_epi16(sl, sc_l), _mm256_madd_epi16(sh, sc_h));
                }
                finish_k_scaled(&a, b, (d, dmin, mins), &sumi, &mut acc);
            }
            for (i, v) in acc.iter().enumerate() {
                out.write(i, r, hsum_ps(*v));
            }
        }
    }
}

/// The 256 quants of a Q4_K block at `blk` as unsigned bytes, transposed as `q4_k_rows`
/// describes: four vectors of low nibbles and four of high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_k_quants(blk: *const u8) -> ([__m256i; 4], [__m256i; 4]) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `blk` points at (or is) one whole block of the
    // type, so the header bytes read lie inside it.
    unsafe {
        let c = [0, 1, 2, 3].map(|j| load(blk.add(16 + 32 * j)));
        nibbles(transpose_dwords(c))
    }
}

/// Low and high nibbles of four vectors of packed 4-bit quants.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(x: [__m256i; 4]) -> ([__m256i; 4], [__m256i; 4]) {
    let m4 = _mm256_set1_epi8(0x0f);
    (
        x.map(|v| _mm256_and_si256(v, m4)),
        x.map(|v| _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)),
    )
}

/// `q4_k_quants` of a block repacked by `repack_q4_k`: its quant bytes are already transposed.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_k_quants_packed(blk: *const u8) -> ([__m256i; 4], [__m256i; 4]) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `blk` points at (or is) one whole block of the
    // type, so the header bytes read lie inside it.
    unsafe { nibbles([0, 1, 2, 3].map(|j| load(blk.add(16 + 32 * j)))) }
}

/// Q4_K blocks rearranged for `q4_k_quants_packed`: header as is, quant bytes transposed by
/// dwords within 128-bit halves. `src` and `dst` hold the same whole number of blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn repack_q4_k(src: &[u8], dst: &mut [u8]) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `src`, `dst` have the lengths the callers size
    // them to, so the pointer reads and writes stay inside them.
    unsafe {
        for (s, d) in src.chunks_exact(144).zip(dst.chunks_exact_mut(144)) {
            d[..16].copy_from_slice(&s[..16]);
            let c = [0, 1, 2, 3].map(|j| load(s.as_ptr().add(16 + 32 * j)));
            for (j, v) in transpose_dwords(c).into_iter().enumerate() {
                _mm256_storeu_si256(d.as_mut_ptr().add(16 + 32 * j) as *mut __m256i, v);
            }
        }
    }
}

/// Dword m of output j (within each 128-bit half) is dword j of input m.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose_dwords(q: [__m256i; 4]) -> [__m256i; 4] {
    let t0 = _mm256_unpacklo_epi32(q[0], q[1]);
    let t1 = _mm256_unpackhi_epi32(q[0], q[1]);
    let t2 = _mm256_unpacklo_epi32(q[2], q[3]);
    let t3 = _mm256_unpackhi_epi32(q[2], q[3]);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// One activation row (Q8_K values) in the order `q4_k_rows` multiplies them: per 256-block,
/// for u in 0..4 the 32 values under the low nibbles of transposed vector u, then the 32
/// under its high nibbles. Dword m < 4 of vector u is weights 4u..4u+4 of sub-block σ(m);
/// dword m ≥ 4 is weights 16+4u..16+4u+4 of sub-block σ(m − 4).
pub(super) fn q4_k_permute_act(x: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; x.len()];
    for (src, dst) in x.chunks_exact(256).zip(out.chunks_exact_mut(256)) {
        for u in 0..4 {
            for half in 0..2 {
                for m in 0..8 {
                    let sub = 2 * (m % 4) + half;
                    let from = 32 * sub + 16 * (m / 4) + 4 * u;
                    let to = 64 * u + 32 * half + 4 * m;
                    dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
                }
            }
        }
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_rows<const N: usize>(m: &QMatrix, rows: Range<usize>, act: &ActRows, out: &OutSink) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `rows` lie inside the matrix `m` (validated by
    // `QMatrix::new`), `act` is quantized for its type and width, and `out` holds every
    // (activation, row) written, which no other thread writes.
    unsafe {
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
}

/// Q6_K: weights unsigned 0..63 (true value + 32); the offset is subtracted exactly in
/// integers through the activation 16-sums times 32·scale. As in `q4_k_rows`, the four
/// 32-weight vectors of each 128-weight half are transposed by dwords within 128-bit halves,
/// which gives all four the same sub-block per dword (σ(m) = 8n + [0,2,4,6,1,3,5,7][m]); two
/// of them can then share one scale multiply (2 · 2·63·127 < 2^15): 8 `maddubs` + 4 `madd` +
/// 1 offset `madd` per block and row instead of 8 + 8 + 1. Activations are permuted to match
/// once per call (`q6_k_permute_act`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_rows<const N: usize, const PACKED: bool>(
    m: &QMatrix,
    rows: Range<usize>,
    act: &ActRows,
    out: &OutSink,
) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `rows` lie inside the matrix `m` (validated by
    // `QMatrix::new`), `act` is quantized for its type and width, and `out` holds every
    // (activation, row) written, which no other thread writes.
    unsafe {
        let nb = m.cols / 256;
        let a = act_ptrs::<N>(act);
        let permuted: [Vec<u8>; N] =
            core::array::from_fn(|i| q6_k_permute_act(core::slice::from_raw_parts(a.x[i], m.cols)));
        let xp: [*const u8; N] = core::array::from_fn(|i| permuted[i].as_ptr());
        let sigma = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 1, 1, 3, 3, 5, 5, 7, 7);
        for r in rows {
            let w = m.row(r);
            debug_assert!(w.len() == 210 * nb);
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..nb {
                let p = w.as_ptr().add(210 * b);
                prefetch_ahead(p, 210);
                let d = f16_at(p.add(208));
                let sc8 = _mm_loadu_si128(p.add(192) as *const __m128i);
                let s16 = _mm256_cvtepi8_epi16(sc8);
                let mut sumi = [_mm256_setzero_si256(); N];
                for n in 0..2 {
                    let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                        sc8,
                        _mm_add_epi8(sigma, _mm_set1_epi8(8 * n as i8)),
                    ));
                    let x = if PACKED {
                        q6_k_quants_packed(p, n)
                    } else {
                        q6_k_quants(p, n)
                    };
                    for i in 0..N {
                        let xb = xp[i].add(256 * b + 128 * n);
                        let p01 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(x[0], load(xb)),
                            _mm256_maddubs_epi16(x[1], load(xb.add(32))),
                        );
                        let p23 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(x[2], load(xb.add(64))),
                            _mm256_maddubs_epi16(x[3], load(xb.add(96))),
                        );
                        sumi[i] = _mm256_add_epi32(
                            sumi[i],
                            _mm256_add_epi32(
                                _mm256_madd_epi16(p01, sc),
                                _mm256_madd_epi16(p23, sc),
                            ),
                        );
                    }
                }
                let mins = _mm256_slli_epi16(s16, 5);
                for i in 0..N {
                    let ad = *a.d[i].add(b);
                    let off = _mm256_madd_epi16(load(a.bsums[i].add(32 * b)), mins);
                    let total = _mm256_sub_epi32(sumi[i], off);
                    acc[i] =
                        _mm256_fmadd_ps(_mm256_set1_ps(d * ad), _mm256_cvtepi32_ps(total), acc[i]);
                }
            }
            for (i, v) in acc.iter().enumerate() {
                out.write(i, r, hsum_ps(*v));
            }
        }
    }
}

/// The quants of 128-weight half `n` of the Q6_K block at `p` as unsigned bytes 0..63,
/// transposed as `q6_k_rows` describes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_quants(p: *const u8, n: usize) -> [__m256i; 4] {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `p` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe {
        // The ggml bytes decoded in place are the vectors before the transposition.
        transpose_dwords(q6_k_quants_packed(p, n))
    }
}

/// The four 6-bit vectors of half `n` decoded where they lie: weights 0..32, 32..64, 64..96,
/// 96..128 of the half for a ggml block; for a block repacked by `repack_q6_k`, whose bytes
/// were arranged for it, directly `q6_k_quants`' transposed vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_quants_packed(p: *const u8, n: usize) -> [__m256i; 4] {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `p` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let m2h = _mm256_set1_epi8(0x30);
        // Two high bits 2c..2c+2 of h moved to bits 4..6 (16-bit shifts; the mask drops what
        // crosses byte borders).
        let a = load(p.add(64 * n));
        let b = load(p.add(64 * n + 32));
        let h = load(p.add(128 + 32 * n));
        [
            _mm256_or_si256(
                _mm256_and_si256(a, m4),
                _mm256_and_si256(_mm256_slli_epi16(h, 4), m2h),
            ),
            _mm256_or_si256(
                _mm256_and_si256(b, m4),
                _mm256_and_si256(_mm256_slli_epi16(h, 2), m2h),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                _mm256_and_si256(h, m2h),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(h, 2), m2h),
            ),
        ]
    }
}

/// Q6_K blocks rearranged for `q6_k_quants_packed`: per 128-weight half, the transposed 6-bit
/// vectors x0..x3 of `q6_k_quants` stored as low nibbles (x0 | x2 << 4, then x1 | x3 << 4) and
/// high bit pairs (x0, x1, x2, x3 in bits 0–1, 2–3, 4–5, 6–7), in place of ql and qh; scales and
/// d as they are. `src` and `dst` hold the same whole number of blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn repack_q6_k(src: &[u8], dst: &mut [u8]) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `src`, `dst` have the lengths the callers size
    // them to, so the pointer reads and writes stay inside them.
    unsafe {
        for (s, d) in src.chunks_exact(210).zip(dst.chunks_exact_mut(210)) {
            d[192..].copy_from_slice(&s[192..]);
            let (m4, m2) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x03));
            // Values are at most 63, so masked 16-bit shifts keep every bit in its byte.
            let nib = |v: __m256i| _mm256_and_si256(v, m4);
            let top = |v: __m256i| _mm256_and_si256(_mm256_srli_epi16(v, 4), m2);
            let dp = d.as_mut_ptr();
            for n in 0..2 {
                let x = q6_k_quants(s.as_ptr(), n);
                let a = _mm256_or_si256(nib(x[0]), _mm256_slli_epi16(nib(x[2]), 4));
                let b = _mm256_or_si256(nib(x[1]), _mm256_slli_epi16(nib(x[3]), 4));
                let h01 = _mm256_or_si256(top(x[0]), _mm256_slli_epi16(top(x[1]), 2));
                let h23 = _mm256_or_si256(
                    _mm256_slli_epi16(top(x[2]), 4),
                    _mm256_slli_epi16(top(x[3]), 6),
                );
                _mm256_storeu_si256(dp.add(64 * n) as *mut __m256i, a);
                _mm256_storeu_si256(dp.add(64 * n + 32) as *mut __m256i, b);
                _mm256_storeu_si256(
                    dp.add(128 + 32 * n) as *mut __m256i,
                    _mm256_or_si256(h01, h23),
                );
            }
        }
    }
}

/// One activation row (Q8_K values) in the order `q6_k_rows` multiplies them: per 128-weight
/// half, for u in 0..4 the 32 values under transposed vector u, whose dword m < 4 is weights
/// 32m+4u..+4 of the half and dword m ≥ 4 is weights 32(m−4)+16+4u..+4.
pub(super) fn q6_k_permute_act(x: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; x.len()];
    for (src, dst) in x.chunks_exact(128).zip(out.chunks_exact_mut(128)) {
        for u in 0..4 {
            for m in 0..8 {
                let from = 32 * (m % 4) + 16 * (m / 4) + 4 * u;
                let to = 32 * u + 4 * m;
                dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
            }
        }
    }
    out
}

/// Defines the Q8_0 kernel `q8_0_rows` (the body of a `RowsFn`) compiled for `$feat`, with
/// `$block_sum(|w|, sign(x, w))` forming a block's eight i32 lane sums, taking weight rows
/// `$rows_at_once` (1, 2 or 4) at a time so they share each activation load. The invoking
/// module has `ActPtrs`, `act_ptrs`, `q8_0_groups`, `load`, `prefetch_ahead`, `f16_at`,
/// `hsum_ps`, `hsum_ps_x8`, `QMatrix`, `OutSink`, `ActRows` and `Range` in scope.
///
/// Q8_0 against Q8_0 activations: |w|·sign(x, w) pairs; even and odd blocks feed separate
/// accumulators (as `dot_legacy` does) to hide the FMA latency. Two accumulators per row do
/// not fit the registers beyond four activation rows, so larger passes run the weight rows
/// against groups of at most four activation rows (`q8_0_groups`). Eight weight rows at a
/// time have their lane sums reduced together (`hsum_ps_x8`, the same adds as `hsum_ps`)
/// and stored at once: with a narrow matrix (four blocks a row in a 128-wide model) one
/// output's reduction costs as much as its products. A row's operations are the same in
/// every group, tile and pass, so its result does not depend on them.
macro_rules! q8_0_kernel {
    ($feat:literal, $block_sum:ident, $rows_at_once:literal) => {
        #[target_feature(enable = $feat)]
        unsafe fn q8_0_rows<const N: usize>(
            m: &QMatrix,
            rows: Range<usize>,
            act: &ActRows,
            out: &OutSink,
        ) {
            // SAFETY: the CPU has this kernel's features (`$feat`) (this runs only under kernels
            // compiled for them, which the dispatcher chose after checking the CPU); `rows` lie
            // inside the matrix `m` (validated by `QMatrix::new`), `act` is quantized for its
            // type and width, and `out` holds every (activation, row) written, which no other
            // thread writes.
            unsafe {
                let a = act_ptrs::<N>(act);
                let mut r = rows.start;
                while r < rows.end {
                    // Eight rows at a time, the last few of a range one by one.
                    let eight = r + 8 <= rows.end;
                    q8_0_groups(&a, |g, first| match g.len() {
                        1 => q8_0_rows_at::<1>(m, r, eight, &ActPtrs::pick(g), first, out),
                        2 => q8_0_rows_at::<2>(m, r, eight, &ActPtrs::pick(g), first, out),
                        3 => q8_0_rows_at::<3>(m, r, eight, &ActPtrs::pick(g), first, out),
                        _ => q8_0_rows_at::<4>(m, r, eight, &ActPtrs::pick(g), first, out),
                    });
                    r += if eight { 8 } else { 1 };
                }
            }
        }

        /// Weight rows `r..r + 8` (`eight`) or row `r` against the activation rows of `a`,
        /// which are rows `first..` of the pass.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q8_0_rows_at<const N: usize>(
            m: &QMatrix,
            r: usize,
            eight: bool,
            a: &ActPtrs<N>,
            first: usize,
            out: &OutSink,
        ) {
            // SAFETY: the CPU has this kernel's features (`$feat`) (this runs only under kernels
            // compiled for them, which the dispatcher chose after checking the CPU); rows
            // `r..r + 8` (`eight`) or row `r` are rows of the matrix `m` (validated by
            // `QMatrix::new`), the pointers in `a` cover whole activation rows of the matrix's
            // width, `out` holds every (activation, row) written, which no other thread writes.
            unsafe {
                if eight {
                    let mut lanes = [[_mm256_setzero_ps(); 8]; N];
                    let mut k = 0;
                    while k < 8 {
                        q8_0_lanes::<N, $rows_at_once, 8>(m, r + k, a, &mut lanes, k);
                        k += $rows_at_once;
                    }
                    for i in 0..N {
                        _mm256_storeu_ps(out.eight_at(first + i, r), hsum_ps_x8(&lanes[i]));
                    }
                } else {
                    let mut lanes = [[_mm256_setzero_ps(); 1]; N];
                    q8_0_lanes::<N, 1, 1>(m, r, a, &mut lanes, 0);
                    for i in 0..N {
                        out.write(first + i, r, hsum_ps(lanes[i][0]));
                    }
                }
            }
        }

        /// The eight lane sums of weight rows `r..r + R` against each activation row `i` of
        /// `a`, into `lanes[i][at..at + R]`.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q8_0_lanes<const N: usize, const R: usize, const L: usize>(
            m: &QMatrix,
            r: usize,
            a: &ActPtrs<N>,
            lanes: &mut [[__m256; L]; N],
            at: usize,
        ) {
            // SAFETY: as for `q8_0_rows_at`, for rows `r..r + R`.
            unsafe {
                let nb = m.cols / 32;
                let mut w = [core::ptr::null::<u8>(); R];
                for j in 0..R {
                    w[j] = m.row(r + j).as_ptr();
                    debug_assert!(m.row(r + j).len() == 34 * nb);
                }
                // Even blocks accumulate into `acc0`, odd ones into `acc1`; indexing one array
                // by parity would keep the accumulators in memory.
                let mut acc0 = [[_mm256_setzero_ps(); N]; R];
                let mut acc1 = [[_mm256_setzero_ps(); N]; R];
                let mut b = 0;
                while b + 2 <= nb {
                    q8_0_block(&w, a, b, &mut acc0);
                    q8_0_block(&w, a, b + 1, &mut acc1);
                    b += 2;
                }
                if b < nb {
                    q8_0_block(&w, a, b, &mut acc0);
                }
                for j in 0..R {
                    for i in 0..N {
                        lanes[i][at + j] = _mm256_add_ps(acc0[j][i], acc1[j][i]);
                    }
                }
            }
        }

        /// Block `b` of the Q8_0 rows at `w` against every activation row:
        /// acc += d_w·d_a·Σ(w·x).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q8_0_block<const N: usize, const R: usize>(
            w: &[*const u8; R],
            a: &ActPtrs<N>,
            b: usize,
            acc: &mut [[__m256; N]; R],
        ) {
            // SAFETY: the CPU has this kernel's features (`$feat`) (this runs only under kernels
            // compiled for them, which the dispatcher chose after checking the CPU); each `w[j]`
            // points at a whole weight row, the pointers in `a` cover whole activation rows of
            // the matrix's width, so block `b` lies inside them.
            unsafe {
                let mut d = [0f32; R];
                let mut q = [_mm256_setzero_si256(); R];
                let mut qabs = [_mm256_setzero_si256(); R];
                for j in 0..R {
                    let p = w[j].add(34 * b);
                    prefetch_ahead(p, 34);
                    d[j] = f16_at(p);
                    q[j] = load(p.add(2));
                    qabs[j] = _mm256_abs_epi8(q[j]);
                }
                for i in 0..N {
                    let x = load(a.x[i].add(32 * b));
                    let ad = *a.d[i].add(b);
                    for j in 0..R {
                        let sum = $block_sum(qabs[j], _mm256_sign_epi8(x, q[j]));
                        let s = _mm256_set1_ps(d[j] * ad);
                        acc[j][i] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sum), acc[j][i]);
                    }
                }
            }
        }
    };
}

pub(super) use q8_0_kernel;

/// The eight i32 lane sums of a Q8_0 block's 32 products: `maddubs` pairs, then `madd`
/// against ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_sum_maddubs(qabs: __m256i, xs: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(qabs, xs), _mm256_set1_epi16(1))
}

q8_0_kernel!("avx2,fma,f16c", block_sum_maddubs, 1);

/// Calls `f(group, first)` for the activation rows of `a` in groups of at most four, `first`
/// being the group's first row in the pass.
#[inline]
pub(super) fn q8_0_groups<const N: usize>(
    a: &ActPtrs<N>,
    mut f: impl FnMut(&[(*const u8, *const f32)], usize),
) {
    let rows: [(*const u8, *const f32); N] = core::array::from_fn(|i| (a.x[i], a.d[i]));
    for (k, g) in rows.chunks(4).enumerate() {
        f(g, 4 * k);
    }
}

impl<const N: usize> ActPtrs<N> {
    /// The rows `g` (quant and scale pointers; Q8_0 activations have no 16-sums).
    #[inline]
    pub(super) fn pick(g: &[(*const u8, *const f32)]) -> ActPtrs<N> {
        debug_assert!(g.len() == N);
        ActPtrs {
            x: core::array::from_fn(|i| g[i].0),
            d: core::array::from_fn(|i| g[i].1),
            bsums: [core::ptr::null(); N],
        }
    }
}

/// Defines `$name`, a `RowsFn` (compiled for `$feat`) that runs `$kernel::<N>` for the
/// pass's row count.
macro_rules! by_row_count {
    ($name:ident, $kernel:ident $(<$packed:literal>)?, $feat:literal) => {
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $name(
            m: &QMatrix,
            rows: Range<usize>,
            act: &ActRows,
            _decoded: &mut DecodedRow,
            out: &OutSink,
        ) {
            // SAFETY: the CPU has this kernel's features (`$feat`) (this runs only under kernels
            // compiled for them, which the dispatcher chose after checking the CPU); `rows` lie
            // inside the matrix `m` (validated by `QMatrix::new`), `act` is quantized for its type
            // and width, and `out` holds every (activation, row) written, which no other thread
            // writes.
            unsafe {
                match act.n_rows {
                    0 => {}
                    1 => $kernel::<1 $(, $packed)?>(m, rows, act, out),
                    2 => $kernel::<2 $(, $packed)?>(m, rows, act, out),
                    3 => $kernel::<3 $(, $packed)?>(m, rows, act, out),
                    4 => $kernel::<4 $(, $packed)?>(m, rows, act, out),
                    5 => $kernel::<5 $(, $packed)?>(m, rows, act, out),
                    6 => $kernel::<6 $(, $packed)?>(m, rows, act, out),
                    7 => $kernel::<7 $(, $packed)?>(m, rows, act, out),
                    8 => $kernel::<8 $(, $packed)?>(m, rows, act, out),
                    n => unreachable!("{n} activation rows in one pass (at most 8)"),
                }
            }
        }
    };
}

pub(super) use by_row_count;

by_row_count!(rows_q4_k, q4_k_rows<false>, "avx2,fma,f16c");
by_row_count!(rows_q4_k_packed, q4_k_rows<true>, "avx2,fma,f16c");
by_row_count!(rows_q5_k, q5_k_rows, "avx2,fma,f16c");
by_row_count!(rows_q6_k, q6_k_rows<false>, "avx2,fma,f16c");
by_row_count!(rows_q6_k_packed, q6_k_rows<true>, "avx2,fma,f16c");
by_row_count!(rows_q8_0, q8_0_rows, "avx2,fma,f16c");
