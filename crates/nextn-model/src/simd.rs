//! Hot model loops compiled twice: for the baseline target and with AVX2 enabled, the AVX2
//! copy taken at run time where the CPU has it. The loops are written so the compiler can
//! vectorise them without reordering any float operation (element-wise updates, and sums
//! kept in fixed lanes), and AVX2 alone allows no fused multiply-add, so both copies compute
//! the same bits; the AVX2 one does it on 256-bit vectors instead of 128-bit ones.

/// Whether the CPU can run the AVX2 copies (detected once, then a cached flag).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// Defines `fn $name(args) -> ret { body }` as a dispatcher over two copies of `body`: one
/// compiled with AVX2 enabled (used when [`has_avx2`]), one for the baseline target, which
/// tests reach as `$baseline` to check that both give the same bits.
macro_rules! avx2_and_baseline {
    (
        baseline = $baseline:ident;
        $(#[$meta:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        #[inline(always)]
        fn $baseline($($arg: $ty),*) $(-> $ret)? $body

        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn with_avx2($($arg: $ty),*) $(-> $ret)? {
                    $baseline($($arg),*)
                }
                if $crate::simd::has_avx2() {
                    // SAFETY: the CPU supports AVX2 (checked above).
                    return unsafe { with_avx2($($arg),*) };
                }
            }
            $baseline($($arg),*)
        }
    };
}

pub(crate) use avx2_and_baseline;

/// In a test of the two copies: say (past the test harness's capture) that the AVX2 copy of
/// `what` is not compared on this CPU, which fails under `CI=true` (every CI machine has AVX2).
#[cfg(test)]
pub(crate) fn report_missing_avx2(what: &str) {
    #[cfg(target_arch = "x86_64")]
    if !has_avx2() {
        nextn_testdata::cpu_feature_missing("avx2", what);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = what;
}

/// Whether the CPU converts half floats in hardware (F16C, with the AVX registers it uses).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_f16c() -> bool {
    std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
}

/// `dst[i] = src[i]` as f32 for half-float bit patterns `src`. The conversion is exact, so the
/// F16C path (eight at a time) and the scalar one give the same bits.
#[inline]
pub(crate) fn widen_f16(src: &[u16], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU has F16C and AVX (checked above).
        unsafe { widen_f16_f16c(src, dst) };
        return;
    }
    widen_f16_scalar(src, dst);
}

/// The scalar reference of [`widen_f16`].
#[inline]
pub(crate) fn widen_f16_scalar(src: &[u16], dst: &mut [f32]) {
    for (d, &h) in dst.iter_mut().zip(src) {
        *d = nextn_quant::formats::f16_to_f32(h);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16_f16c(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = src.len().min(dst.len());
    let wide = n / 8 * 8;
    for i in (0..wide).step_by(8) {
        // SAFETY: i + 8 <= n for both slices; unaligned loads and stores.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    widen_f16_scalar(&src[wide..n], &mut dst[wide..n]);
}

pub(crate) use nextn_quant::kernels::exp_nonpositive;

#[cfg(test)]
mod tests {
    use super::*;

    /// F16C and the scalar conversion agree on every half-float bit pattern.
    #[test]
    fn widen_f16_agrees_with_the_scalar_conversion_on_every_value() {
        #[cfg(target_arch = "x86_64")]
        if !has_f16c() {
            nextn_testdata::cpu_feature_missing("f16c", "the F16C half-float conversion");
        }
        let src: Vec<u16> = (0..=u16::MAX).collect();
        let (mut a, mut b) = (vec![0.0f32; src.len()], vec![0.0f32; src.len()]);
        widen_f16(&src, &mut a);
        widen_f16_scalar(&src, &mut b);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "{i:#06x}: {x} vs {y}"
            );
        }
    }
}
