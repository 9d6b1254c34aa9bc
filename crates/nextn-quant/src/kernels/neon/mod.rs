//! aarch64 NEON kernels (baseline Advanced SIMD, always present on aarch64): per weight
//! row one decoder fills the `DecodedRow`, then one dot function runs per activation row.

mod decode;
mod dot;

use std::ops::Range;

use super::act::ActRows;
use super::decoded_row::DecodedRow;
use super::matrix::{OutSink, QMatrix, RowsFn};
use crate::GgmlType;
use decode::*;
use dot::*;

macro_rules! kernels {
    ($( $ty:ident => $decode:ident, $dot:expr; )*) => {
        #[allow(non_snake_case)]
        mod neon_kernels {
            use super::*;
            $(
                pub(super) unsafe fn $ty(m: &QMatrix, rows: Range<usize>, act: &ActRows, st: &mut DecodedRow, out: &OutSink) {
                    // SAFETY: NEON is part of every aarch64 CPU; `rows` lie inside the matrix `m`
                    // (validated by `QMatrix::new`), `act` is quantized for its type and width,
                    // `st` was made for them, and `out` holds every (activation, row) written,
                    // which no other thread writes.
                    unsafe {
                        let nb = m.cols / m.ty.block_size();
                        for r in rows {
                            let w = m.row(r);
                            $decode(w, st, nb);
                            for i in 0..act.n_rows {
                                let a = act.row(i);
                                out.write(i, r, ($dot)(w, &*st, &a, nb));
                            }
                        }
                    }
                }
            )*
        }

        /// The NEON kernel for a supported `ty`.
        pub(crate) fn rows_fn(ty: GgmlType) -> RowsFn {
            match ty {
                $( GgmlType::$ty => neon_kernels::$ty as RowsFn, )*
                _ => unreachable!("no NEON kernel for {ty}"),
            }
        }
    };
}

kernels! {
    F32 => decode_none, dot_f32_row;
    F16 => decode_f16, dot_f32_staged;
    BF16 => decode_bf16, dot_f32_staged;
    Q4_0 => decode_q4_0, dot_legacy::<false>;
    Q4_1 => decode_q4_1, dot_legacy::<true>;
    Q5_0 => decode_q5_0, dot_legacy::<false>;
    Q5_1 => decode_q5_1, dot_legacy::<true>;
    Q8_0 => decode_q8_0, dot_legacy::<false>;
    IQ4_NL => decode_iq4_nl, dot_legacy::<false>;
    MXFP4 => decode_mxfp4, dot_legacy::<false>;
    Q2_K => decode_q2_k, dot_k::<true>;
    Q3_K => decode_q3_k, dot_k::<false>;
    Q4_K => decode_q4_k, dot_k::<true>;
    Q5_K => decode_q5_k, dot_k::<true>;
    Q6_K => decode_q6_k, dot_k::<false>;
    Q8_K => decode_q8_k, dot_k::<false>;
    IQ4_XS => decode_iq4_xs, dot_k::<false>;
}
