//! VNNI versions of the fused Q4_K, Q6_K and Q8_0 kernels, for CPUs with AVX512-VNNI (with
//! AVX512-VL, on 256-bit vectors) or AVX-VNNI. `vpdpbusd` adds the four u8×i8 products of
//! each dword to an i32 lane in one instruction, where AVX2 needs `vpmaddubsw` + `vpmaddwd`
//! (+ an add); `vpdpwssd` is `vpmaddwd` + add. Per block and extra activation row that is 10
//! integer instructions instead of 17 for Q4_K, 12 instead of 20 for Q6_K, and per 32-weight
//! block 2 instead of 3 for Q8_0: the work a verify pass of several rows pays for.
//!
//! The weight side (block header, quant decode and transposition, prefetch) is the AVX2
//! kernels' own code. Every integer sum per i32 lane is the one the AVX2 kernel forms, and
//! the f32 steps after it are the same, so results equal `fused`'s bit for bit (tested, with
//! the VNNI instructions emulated in AVX2 on CPUs without them).

// The row loops index several per-row arrays (pointers, accumulators) in step.
#![allow(clippy::needless_range_loop)]

#[cfg(test)]
use core::arch::x86_64::*;

use super::super::matrix::RowsFn;
use super::super::simd::SimdLevel;
use crate::GgmlType;

/// Defines module `$module` with the fused Q4_K, Q6_K and Q8_0 `RowsFn`s, compiled for
/// `$feat`, with `$dpbusd` (acc + Σ4 u8×i8 per dword) and `$dpwssd` (acc + Σ2 i16×i16 per
/// dword) as the multiply-adds; the Q8_0 kernel takes `$q8_0_rows_at_once` weight rows at a
/// time (2 where AVX512-VL gives 32 vector registers, 1 with 16).
macro_rules! vnni_kernels {
    ($module:ident, $feat:literal, $dpbusd:path, $dpwssd:path, $q8_0_rows_at_once:literal) => {
        pub(super) mod $module {
            #![allow(clippy::needless_range_loop)]
            use core::arch::x86_64::*;
            use std::ops::Range;

            use super::super::super::act::ActRows;
            use super::super::super::matrix::{OutSink, QMatrix};
            use super::super::super::decoded_row::DecodedRow;
            use super::super::decode_legacy::f16_at;
            use super::super::dot_avx2::{hsum_ps, hsum_ps_x8};
            use super::super::fused::{
                act_ptrs, by_row_count, finish_k_scaled, k4_header, load, prefetch_ahead,
                q4_k_permute_act, q4_k_quants, q4_k_quants_packed, q6_k_permute_act, q6_k_quants,
                q6_k_quants_packed, q8_0_groups, q8_0_kernel,
                ActPtrs,
            };

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn dpbusd(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
                // SAFETY: the CPU has this kernel's features (`$feat`): this runs only under
                // kernels compiled for them, which the dispatcher chose after checking the CPU.
                // The hardware instruction is safe there; the emulated one is an unsafe fn.
                #[allow(unused_unsafe)]
                let sum = unsafe { $dpbusd(acc, w, x) };
                sum
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
                // SAFETY: the CPU has this kernel's features (`$feat`): this runs only under
                // kernels compiled for them, which the dispatcher chose after checking the CPU.
                // The hardware instruction is safe there; the emulated one is an unsafe fn.
                #[allow(unused_unsafe)]
                let sum = unsafe { $dpwssd(acc, a, b) };
                sum
            }

            /// As `fused::q4_k_rows`. Per lane, the 16 products under the low nibbles
            /// (|Σ| ≤ 16·15·128 < 2^15) are summed in i32 by `dpbusd` and fit an i16, so
            /// `dpwssd` against a dword holding (scale, 0) multiplies them by their
            /// sub-block scale exactly; likewise the high nibbles.
            #[target_feature(enable = $feat)]
            unsafe fn q4_k_rows<const N: usize, const PACKED: bool>(
                m: &QMatrix,
                rows: Range<usize>,
                act: &ActRows,
                out: &OutSink,
            ) {
                // SAFETY: the CPU has this kernel's features (`$feat`) (this runs only under
                // kernels compiled for them, which the dispatcher chose after checking the CPU);
                // `rows` lie inside the matrix `m` (validated by `QMatrix::new`), `act` is
                // quantized for its type and width, and `out` holds every (activation, row)
                // written, which no other thread writes.
                unsafe {
                    let nb = m.cols / 256;
                    let a = act_ptrs::<N>(act);
                    let permuted: [Vec<u8>; N] = core::array::from_fn(|i| {
                        q4_k_permute_act(core::slice::from_raw_parts(a.x[i], m.cols))
                    });
                    let xp: [*const u8; N] = core::array::from_fn(|i| permuted[i].as_ptr());
                    // The i16 scale of sub-block σL(m) (resp. σH(m)) in the low half of dword m,
                    // zero in the high half.
                    #[rustfmt::skip]
                    let (pick_l, pick_h) = (
                        _mm256_setr_epi8(0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13, -1, -1,
                                         0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13, -1, -1),
                        _mm256_setr_epi8(2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1,
                                         2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1),
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
                                let mut sl = _mm256_setzero_si256();
                                let mut sh = _mm256_setzero_si256();
                                for u in 0..4 {
                                    sl = dpbusd(sl, lo[u], load(xb.add(64 * u)));
                                    sh = dpbusd(sh, hi[u], load(xb.add(64 * u + 32)));
                                }
                                sumi[i] = dpwssd(dpwssd(_mm256_setzero_si256(), sl, sc_l), sh, sc_h);
                            }
                            finish_k_scaled(&a, b, (d, dmin, mins), &sumi, &mut acc);
                        }
                        for (i, v) in acc.iter().enumerate() {
                            out.write(i, r, hsum_ps(*v));
                        }
                    }
                }
            }

            /// As `fused::q6_k_rows`. A lane's 16 products per 128-weight half can reach
            /// 16·63·128 > 2^15, so the scale is applied with one i32 multiply.
            #[target_feature(enable = $feat)]
            unsafe fn q6_k_rows<const N: usize, const PACKED: bool>(
                m: &QMatrix,
                rows: Range<usize>,
                act: &ActRows,
                out: &OutSink,
            ) {
                // SAFETY: the CPU has this kernel's features (`$feat`) (this runs only under
                // kernels compiled for them, which the dispatcher chose after checking the CPU);
                // `rows` lie inside the matrix `m` (validated by `QMatrix::new`), `act` is
                // quantized for its type and width, and `out` holds every (activation, row)
                // written, which no other thread writes.
                unsafe {
                    let nb = m.cols / 256;
                    let a = act_ptrs::<N>(act);
                    let permuted: [Vec<u8>; N] = core::array::from_fn(|i| {
                        q6_k_permute_act(core::slice::from_raw_parts(a.x[i], m.cols))
                    });
                    let xp: [*const u8; N] = core::array::from_fn(|i| permuted[i].as_ptr());
                    // Sub-block σ(m) of dword m within a 128-weight half.
                    let sigma = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0);
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
                                let sc = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(
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
                                    let mut s = _mm256_setzero_si256();
                                    for u in 0..4 {
                                        s = dpbusd(s, x[u], load(xb.add(32 * u)));
                                    }
                                    sumi[i] = _mm256_add_epi32(sumi[i], _mm256_mullo_epi32(s, sc));
                                }
                            }
                            let mins = _mm256_slli_epi16(s16, 5);
                            for i in 0..N {
                                let ad = *a.d[i].add(b);
                                let off = _mm256_madd_epi16(load(a.bsums[i].add(32 * b)), mins);
                                let total = _mm256_sub_epi32(sumi[i], off);
                                acc[i] = _mm256_fmadd_ps(
                                    _mm256_set1_ps(d * ad),
                                    _mm256_cvtepi32_ps(total),
                                    acc[i],
                                );
                            }
                        }
                        for (i, v) in acc.iter().enumerate() {
                            out.write(i, r, hsum_ps(*v));
                        }
                    }
                }
            }

            /// The eight i32 lane sums of a Q8_0 block's 32 products, by `dpbusd`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn block_sum_dpbusd(qabs: __m256i, xs: __m256i) -> __m256i {
                // SAFETY: as for `dpbusd`.
                unsafe { dpbusd(_mm256_setzero_si256(), qabs, xs) }
            }

            q8_0_kernel!($feat, block_sum_dpbusd, $q8_0_rows_at_once);

            by_row_count!(rows_q4_k, q4_k_rows<false>, $feat);
            by_row_count!(rows_q6_k, q6_k_rows<false>, $feat);
            by_row_count!(rows_q4_k_packed, q4_k_rows<true>, $feat);
            by_row_count!(rows_q6_k_packed, q6_k_rows<true>, $feat);
            by_row_count!(rows_q8_0, q8_0_rows, $feat);

            /// This family's kernel for `ty` on matrices repacked by `repack`, if it has one.
            pub(super) fn packed_rows_fn(ty: crate::GgmlType) -> Option<super::RowsFn> {
                match ty {
                    crate::GgmlType::Q4_K => Some(rows_q4_k_packed),
                    crate::GgmlType::Q6_K => Some(rows_q6_k_packed),
                    _ => None,
                }
            }

            /// This family's kernel for `ty`, if it has one.
            pub(super) fn rows_fn(ty: crate::GgmlType) -> Option<super::RowsFn> {
                match ty {
                    crate::GgmlType::Q4_K => Some(rows_q4_k),
                    crate::GgmlType::Q6_K => Some(rows_q6_k),
                    crate::GgmlType::Q8_0 => Some(rows_q8_0),
                    _ => None,
                }
            }
        }
    };
}

vnni_kernels!(
    avx512vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    _mm256_dpbusd_epi32,
    _mm256_dpwssd_epi32,
    2
);
vnni_kernels!(
    avxvnni,
    "avx2,fma,f16c,avxvnni",
    _mm256_dpbusd_avx_epi32,
    _mm256_dpwssd_avx_epi32,
    1
);
#[cfg(test)]
vnni_kernels!(
    emulated,
    "avx2,fma,f16c",
    super::emulated_dpbusd,
    super::emulated_dpwssd,
    2
);

/// `vpdpbusd` in AVX2, for testing the VNNI kernels' arithmetic on any AVX2 CPU. Exact when
/// no pair of products saturates i16, which holds for every kernel above (weights ≤ 128 in
/// magnitude against activations in −127..=127, or ≤ 63 against −128..=127).
#[cfg(test)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn emulated_dpbusd(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)),
    )
}

/// `vpdpwssd` in AVX2 (exact).
#[cfg(test)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn emulated_dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
}

/// Which VNNI instructions this CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vnni {
    /// EVEX `vpdpbusd` on 256-bit vectors (AVX512-VNNI with AVX512-VL).
    Avx512,
    /// VEX `vpdpbusd` (AVX-VNNI).
    Avx,
}

/// The VNNI instructions this CPU offers, if any (detected once).
pub(crate) fn detected_vnni() -> Option<Vnni> {
    use std::sync::OnceLock;
    static VNNI: OnceLock<Option<Vnni>> = OnceLock::new();
    *VNNI.get_or_init(|| {
        if !SimdLevel::Avx2.is_supported() {
            None
        } else if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
        {
            Some(Vnni::Avx512)
        } else if is_x86_feature_detected!("avxvnni") {
            Some(Vnni::Avx)
        } else {
            None
        }
    })
}

/// The VNNI kernel for `ty` with the instructions `vnni`, if this family has one.
pub(crate) fn rows_fn(vnni: Vnni, ty: GgmlType) -> Option<RowsFn> {
    match vnni {
        Vnni::Avx512 => avx512vnni::rows_fn(ty),
        Vnni::Avx => avxvnni::rows_fn(ty),
    }
}

/// The VNNI kernel for `ty` on repacked matrices with the instructions `vnni`, if any.
pub(crate) fn packed_rows_fn(vnni: Vnni, ty: GgmlType) -> Option<RowsFn> {
    match vnni {
        Vnni::Avx512 => avx512vnni::packed_rows_fn(ty),
        Vnni::Avx => avxvnni::packed_rows_fn(ty),
    }
}

#[cfg(test)]
pub(super) fn emulated_rows_fn(ty: GgmlType) -> Option<RowsFn> {
    emulated::rows_fn(ty)
}

#[cfg(test)]
pub(super) fn emulated_packed_rows_fn(ty: GgmlType) -> Option<RowsFn> {
    emulated::packed_rows_fn(ty)
}
