//! x86-64 kernels: AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL).
//!
//! Per weight row: one decoder unpacks it into the stage, then one dot function runs per
//! activation row. Decoders are AVX2 code that the AVX-512 kernels reuse (decoding is a
//! small share of the work); the dot products have a version per level.

pub(crate) mod act_avx2;
mod decode_k;
mod decode_legacy;
mod dot_avx2;
mod dot_avx512;

use std::ops::Range;

use super::act::ActRows;
use super::matrix::{OutSink, QMatrix, RowsFn};
use super::simd::SimdLevel;
use super::stage::Stage;
use crate::GgmlType;
use decode_k::*;
use decode_legacy::*;
use dot_avx2::{MINS_NONE, MINS_OFFSET, MINS_SCALED};

/// Defines `$name`: for each weight row, `$decode` it into the stage, then `$dot` it with
/// every activation row. `$feat` must cover what `$decode` and `$dot` are compiled for.
macro_rules! rows_kernel {
    ($name:ident, $feat:literal, $decode:expr, $dot:expr) => {
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $name(
            m: &QMatrix,
            rows: Range<usize>,
            act: &ActRows,
            st: &mut Stage,
            out: &OutSink,
        ) {
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

        /// The kernel for `ty` at `level` (Avx2 or Avx512; the caller has checked that the
        /// CPU supports it and that `ty` is supported).
        #[allow(non_snake_case)]
        pub(crate) fn rows_fn(level: SimdLevel, ty: GgmlType) -> RowsFn {
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

kernels! {
    F32 => decode_none, d2::dot_f32_row, d5::dot_f32_row;
    F16 => decode_f16, d2::dot_f32_staged, d5::dot_f32_staged;
    BF16 => decode_bf16, d2::dot_f32_staged, d5::dot_f32_staged;
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
