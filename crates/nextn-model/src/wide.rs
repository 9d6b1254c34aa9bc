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
                if $crate::wide::has_avx2() {
                    // SAFETY: the CPU supports AVX2 (checked above).
                    return unsafe { with_avx2($($arg),*) };
                }
            }
            $baseline($($arg),*)
        }
    };
}

pub(crate) use avx2_and_baseline;
