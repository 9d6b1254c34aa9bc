//! AVX2 unpacking of 32-element block types into a `DecodedRow`: 32 int8 lanes per block plus
//! the block's f32 scale (and minimum for Q4_1 / Q5_1). The AVX-512 kernels reuse these.

use core::arch::x86_64::*;

use super::super::decoded_row::DecodedRow;
use super::super::tables::{e8m0_to_f32_half, KVALUES_IQ4NL, KVALUES_MXFP4};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `p` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe {
        let bits = (p as *const u16).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
}

/// 16 packed bytes to 32 nibbles: low nibbles in lanes 0..16, high nibbles in 16..32
/// (the element order of every 32-element 4-bit ggml block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nibbles32(p: *const u8) -> __m256i {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `p` points at as many valid elements as the
    // loads below read (the callers pass whole blocks or rows).
    unsafe {
        let q = _mm_loadu_si128(p as *const __m128i);
        let m4 = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(q, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        _mm256_set_m128i(hi, lo)
    }
}

/// 32 bits to 32 bytes: byte j is 0xFF where bit j is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_to_bytes(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    #[rustfmt::skip]
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let v = _mm256_shuffle_epi8(v, spread);
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn table16(values: &[i8; 16]) -> __m256i {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `values` is the 16 bytes the load reads.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(values.as_ptr() as *const __m128i)) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store(st: &mut DecodedRow, b: usize, v: __m256i) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `b` names a chunk inside the decoded row `st`,
    // which the decoder sized for the whole row (debug-asserted below).
    unsafe {
        debug_assert!(st.q.len() >= 32 * (b + 1));
        _mm256_storeu_si256(st.q.as_mut_ptr().add(32 * b) as *mut __m256i, v);
    }
}

/// Signed lanes: the values and their magnitudes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn store_signed(st: &mut DecodedRow, chunk: usize, v: __m256i) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `chunk` names a chunk inside the decoded row
    // `st`, which the decoder sized for the whole row (debug-asserted below).
    unsafe {
        debug_assert!(st.q.len() >= 32 * (chunk + 1) && st.qabs.len() >= 32 * (chunk + 1));
        _mm256_storeu_si256(st.q.as_mut_ptr().add(32 * chunk) as *mut __m256i, v);
        _mm256_storeu_si256(
            st.qabs.as_mut_ptr().add(32 * chunk) as *mut __m256i,
            _mm256_abs_epi8(v),
        );
    }
}

/// Debug-build bounds check for a decoder of `bytes`-byte blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn check(w: &[u8], st: &DecodedRow, nb: usize, bytes: usize) {
    debug_assert!(w.len() >= nb * bytes && st.d.len() >= nb && st.m.len() >= nb);
}

/// Unsigned 0..15: the -8 offset enters through the activation's per-block sums.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q4_0(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 18);
        for b in 0..nb {
            let p = w.as_ptr().add(18 * b);
            *st.d.get_unchecked_mut(b) = f16_at(p);
            store(st, b, nibbles32(p.add(2)));
        }
    }
}

/// Unsigned 0..15: the minimum enters through the activation's `s`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q4_1(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 20);
        for b in 0..nb {
            let p = w.as_ptr().add(20 * b);
            *st.d.get_unchecked_mut(b) = f16_at(p);
            *st.m.get_unchecked_mut(b) = f16_at(p.add(2));
            store(st, b, nibbles32(p.add(4)));
        }
    }
}

/// Unsigned 0..31: the -16 offset enters through the activation's per-block sums.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q5_0(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 22);
        let bit4 = _mm256_set1_epi8(0x10);
        for b in 0..nb {
            let p = w.as_ptr().add(22 * b);
            *st.d.get_unchecked_mut(b) = f16_at(p);
            let qh = (p.add(2) as *const u32).read_unaligned();
            let high = _mm256_and_si256(bits_to_bytes(qh), bit4);
            store(st, b, _mm256_or_si256(nibbles32(p.add(6)), high));
        }
    }
}

/// Unsigned 0..31, minimum through the activation's `s`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q5_1(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 24);
        let bit4 = _mm256_set1_epi8(0x10);
        for b in 0..nb {
            let p = w.as_ptr().add(24 * b);
            *st.d.get_unchecked_mut(b) = f16_at(p);
            *st.m.get_unchecked_mut(b) = f16_at(p.add(2));
            let qh = (p.add(4) as *const u32).read_unaligned();
            let high = _mm256_and_si256(bits_to_bytes(qh), bit4);
            store(st, b, _mm256_or_si256(nibbles32(p.add(8)), high));
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_q8_0(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 34);
        for b in 0..nb {
            let p = w.as_ptr().add(34 * b);
            *st.d.get_unchecked_mut(b) = f16_at(p);
            store_signed(st, b, _mm256_loadu_si256(p.add(2) as *const __m256i));
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_iq4_nl(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 18);
        let table = table16(&KVALUES_IQ4NL);
        for b in 0..nb {
            let p = w.as_ptr().add(18 * b);
            *st.d.get_unchecked_mut(b) = f16_at(p);
            store_signed(st, b, _mm256_shuffle_epi8(table, nibbles32(p.add(2))));
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_mxfp4(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `nb` whole blocks and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 17);
        // Stored as value + MXFP4_OFFSET (0..=24), unsigned; the dot product takes the offset
        // back out through the activation block sums.
        let biased: [i8; 16] = core::array::from_fn(|i| KVALUES_MXFP4[i] + MXFP4_OFFSET as i8);
        let table = table16(&biased);
        for b in 0..nb {
            let p = w.as_ptr().add(17 * b);
            *st.d.get_unchecked_mut(b) = e8m0_to_f32_half(*p);
            store(st, b, _mm256_shuffle_epi8(table, nibbles32(p.add(1))));
        }
    }
}

/// The bias that makes MXFP4's doubled e2m1 levels (-12..=12) non-negative.
pub(super) const MXFP4_OFFSET: i32 = 12;

/// F16 weights widened to f32 (exact), so each activation row reuses them.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_f16(w: &[u8], st: &mut DecodedRow, n: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `n` whole elements and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        debug_assert!(w.len() >= 2 * n && st.f.len() >= n);
        let (src, dst) = (w.as_ptr(), st.f.as_mut_ptr());
        let mut j = 0;
        while j + 8 <= n {
            let h = _mm_loadu_si128(src.add(2 * j) as *const __m128i);
            _mm256_storeu_ps(dst.add(j), _mm256_cvtph_ps(h));
            j += 8;
        }
        while j < n {
            *dst.add(j) = f16_at(src.add(2 * j));
            j += 1;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_bf16(w: &[u8], st: &mut DecodedRow, n: usize) {
    // SAFETY: the CPU has AVX2, FMA and F16C (this runs only under kernels compiled for them, which
    // the dispatcher chose after checking the CPU); `w` holds `n` whole elements and `st` was made
    // for this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        debug_assert!(w.len() >= 2 * n && st.f.len() >= n);
        let (src, dst) = (w.as_ptr(), st.f.as_mut_ptr());
        let mut j = 0;
        while j + 8 <= n {
            let h = _mm_loadu_si128(src.add(2 * j) as *const __m128i);
            let wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
            _mm256_storeu_ps(dst.add(j), _mm256_castsi256_ps(wide));
            j += 8;
        }
        while j < n {
            let bits = (src.add(2 * j) as *const u16).read_unaligned();
            *dst.add(j) = f32::from_bits((bits as u32) << 16);
            j += 1;
        }
    }
}

/// F32 weights are read in place by the dot product.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_none(_w: &[u8], _st: &mut DecodedRow, _n: usize) {}
