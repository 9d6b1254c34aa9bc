//! Activation rows converted to the weight type's "vec_dot_type", once per call.
//!
//! ggml never multiplies a quantized weight by f32 activations directly: it first quantizes
//! the activation row (Q8_0, Q8_1 or Q8_K, or rounds it to F16/BF16) and then takes integer
//! dot products block by block. We do the same, with the quantized values kept in a layout
//! that suits the kernels (scales already widened to f32; their values are the f16-rounded
//! ones ggml stores).

use crate::GgmlType;

/// The representation activations are converted to before the dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    /// 32-element blocks: i8 values and one scale each.
    Q8_0,
    /// Like Q8_0 plus `s = d * Σq` per block, for weights with an additive minimum.
    Q8_1,
    /// 256-element blocks: i8 values, an f32 scale and sums of each 16 values.
    Q8K,
    /// f32 values rounded to f16.
    F16,
    /// f32 values rounded to bf16.
    BF16,
    /// f32 values as given.
    F32,
}

impl ActKind {
    pub(crate) fn for_weight(ty: GgmlType) -> Option<ActKind> {
        use GgmlType as T;
        Some(match ty {
            T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::MXFP4 => ActKind::Q8_0,
            T::Q4_1 | T::Q5_1 => ActKind::Q8_1,
            T::Q2_K | T::Q3_K | T::Q4_K | T::Q5_K | T::Q6_K | T::Q8_K | T::IQ4_XS => ActKind::Q8K,
            T::F16 => ActKind::F16,
            T::BF16 => ActKind::BF16,
            T::F32 => ActKind::F32,
            _ => return None,
        })
    }

    /// Elements per activation block (the granularity of `d`).
    pub(crate) fn block(self) -> usize {
        match self {
            ActKind::Q8_0 | ActKind::Q8_1 => 32,
            ActKind::Q8K => 256,
            ActKind::F16 | ActKind::BF16 | ActKind::F32 => 1,
        }
    }
}

/// `n_rows` activation rows of `cols` elements in one representation.
pub(crate) struct ActRows {
    pub kind: ActKind,
    pub n_rows: usize,
    pub cols: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    dsum: Vec<f32>,
    bsums: Vec<i16>,
    f: Vec<f32>,
}

/// One activation row; only the fields of its kind are non-empty.
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    /// Quantized values (Q8 kinds).
    pub qs: &'a [i8],
    /// Per-block scales (Q8 kinds).
    pub d: &'a [f32],
    /// Per-block `d * Σq` rounded to f16, as ggml's Q8_1 stores it (Q8_1).
    pub s: &'a [f32],
    /// Per-block `d * Σq` in f32, exact (Q8_0): lets kernels fold a weight offset
    /// (Q4_0's -8, Q5_0's -16) into one dot product over blocks. Only the x86 kernels
    /// use it; NEON multiplies signed values directly.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub dsum: &'a [f32],
    /// Sums of each 16 quantized values (Q8K).
    pub bsums: &'a [i16],
    /// Rounded values (F16, BF16, F32).
    pub f: &'a [f32],
}

impl ActRows {
    /// Convert `n_rows` rows of `x` (row-major, `cols` each). `cols` must be a multiple of
    /// the kind's block; the caller has checked that. With `simd`, AVX2 code is used where
    /// available; it produces the same bits as the scalar code.
    pub(crate) fn quantize(
        kind: ActKind,
        x: &[f32],
        n_rows: usize,
        cols: usize,
        simd: bool,
    ) -> ActRows {
        #[cfg(target_arch = "x86_64")]
        let avx2 = simd && super::simd::SimdLevel::Avx2.is_supported();
        #[cfg(not(target_arch = "x86_64"))]
        let avx2 = {
            let _ = simd;
            false
        };
        debug_assert_eq!(x.len(), n_rows * cols);
        debug_assert_eq!(cols % kind.block(), 0);
        let mut rows = ActRows {
            kind,
            n_rows,
            cols,
            qs: Vec::new(),
            d: Vec::new(),
            s: Vec::new(),
            dsum: Vec::new(),
            bsums: Vec::new(),
            f: Vec::new(),
        };
        let nb = cols / kind.block();
        match kind {
            ActKind::Q8_0 | ActKind::Q8_1 => {
                rows.qs = vec![0; n_rows * cols];
                rows.d = vec![0.0; n_rows * nb];
                if kind == ActKind::Q8_1 {
                    rows.s = vec![0.0; n_rows * nb];
                } else {
                    rows.dsum = vec![0.0; n_rows * nb];
                }
                for i in 0..n_rows {
                    let src = &x[i * cols..(i + 1) * cols];
                    let qs = &mut rows.qs[i * cols..(i + 1) * cols];
                    let d = &mut rows.d[i * nb..(i + 1) * nb];
                    let sums = if kind == ActKind::Q8_1 {
                        BlockSums::Q8_1(&mut rows.s[i * nb..(i + 1) * nb])
                    } else {
                        BlockSums::Exact(&mut rows.dsum[i * nb..(i + 1) * nb])
                    };
                    if avx2 {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: AVX2, FMA and F16C are present (checked above).
                        unsafe {
                            super::x86::act_avx2::quantize_q8_0_row(src, qs, d, sums)
                        };
                    } else {
                        quantize_q8_0_row(src, qs, d, sums);
                    }
                }
            }
            ActKind::Q8K => {
                rows.qs = vec![0; n_rows * cols];
                rows.d = vec![0.0; n_rows * nb];
                rows.bsums = vec![0; n_rows * cols / 16];
                for i in 0..n_rows {
                    let src = &x[i * cols..(i + 1) * cols];
                    let qs = &mut rows.qs[i * cols..(i + 1) * cols];
                    let d = &mut rows.d[i * nb..(i + 1) * nb];
                    let bsums = &mut rows.bsums[i * cols / 16..(i + 1) * cols / 16];
                    if avx2 {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: AVX2, FMA and F16C are present (checked above).
                        unsafe {
                            super::x86::act_avx2::quantize_q8k_row(src, qs, d, bsums)
                        };
                    } else {
                        quantize_q8k_row(src, qs, d, bsums);
                    }
                }
            }
            ActKind::F16 | ActKind::BF16 => {
                rows.f = vec![0.0; x.len()];
                let bf16 = kind == ActKind::BF16;
                if avx2 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2, FMA and F16C are present (checked above).
                    unsafe {
                        super::x86::act_avx2::round_row(x, &mut rows.f, bf16)
                    };
                } else {
                    let round = if bf16 {
                        super::tables::round_to_bf16
                    } else {
                        super::tables::round_to_f16
                    };
                    for (o, &v) in rows.f.iter_mut().zip(x) {
                        *o = round(v);
                    }
                }
            }
            ActKind::F32 => rows.f = x.to_vec(),
        }
        rows
    }

    pub(crate) fn row(&self, i: usize) -> ActRow<'_> {
        let cols = self.cols;
        let nb = cols / self.kind.block();
        let slice = |v_len: usize, per_row: usize| {
            if v_len == 0 {
                0..0
            } else {
                i * per_row..(i + 1) * per_row
            }
        };
        ActRow {
            qs: &self.qs[slice(self.qs.len(), cols)],
            d: &self.d[slice(self.d.len(), nb)],
            s: &self.s[slice(self.s.len(), nb)],
            dsum: &self.dsum[slice(self.dsum.len(), nb)],
            bsums: &self.bsums[slice(self.bsums.len(), cols / 16)],
            f: &self.f[slice(self.f.len(), cols)],
        }
    }
}

/// Where the per-block sums of a Q8_0 / Q8_1 row go.
pub(crate) enum BlockSums<'a> {
    /// ggml's Q8_1 `s`: f16(Σq · unrounded d).
    Q8_1(&'a mut [f32]),
    /// Σq · (stored, f16-rounded) d, exact in f32 (|Σq| < 2^12, d has 11 significant bits).
    Exact(&'a mut [f32]),
}

/// Q8_0 (and Q8_1) activation quantization as ggml's x86 CPU backend does it (the backend the
/// llama.cpp reference outputs come from): d = amax/127 stored as f16, values scaled by
/// 127/amax and rounded half to even. (ggml's portable reference scales by 1/d and rounds half
/// away from zero, which differs in the last bit of some quants.)
pub(crate) fn quantize_q8_0_row(x: &[f32], qs: &mut [i8], d: &mut [f32], mut sums: BlockSums) {
    for (b, (xb, qb)) in x.chunks_exact(32).zip(qs.chunks_exact_mut(32)).enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            // |v * inv| <= 127 up to rounding, and `as` saturates anyway.
            *q = (v * inv).round_ties_even() as i8;
            sum += *q as i32;
        }
        d[b] = super::tables::round_to_f16(scale);
        match &mut sums {
            BlockSums::Q8_1(s) => s[b] = super::tables::round_to_f16(sum as f32 * scale),
            BlockSums::Exact(s) => s[b] = sum as f32 * d[b],
        }
    }
}

/// ggml's Q8_K quantization: the value of largest magnitude maps to -127, values rounded
/// half to even and capped at 127, d = 1/iscale kept in f32, plus sums of each 16 values.
pub(crate) fn quantize_q8k_row(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    for (b, (xb, qb)) in x
        .chunks_exact(256)
        .zip(qs.chunks_exact_mut(256))
        .enumerate()
    {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let sums = &mut bsums[b * 16..(b + 1) * 16];
        if amax == 0.0 {
            d[b] = 0.0;
            qb.fill(0);
            sums.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (g, sum) in sums.iter_mut().enumerate() {
            *sum = qb[g * 16..(g + 1) * 16].iter().map(|&q| q as i16).sum();
        }
        d[b] = 1.0 / iscale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_extreme_maps_to_127_and_rounds_half_to_even() {
        let mut x = vec![0.0f32; 32];
        x[0] = 2.54;
        x[1] = -0.01; // -0.01 * 127/2.54 = -0.5 -> half to even: 0 (ggml's x86 rounding)
        x[2] = -2.54;
        x[3] = 0.03; // 1.5 -> 2
        let a = ActRows::quantize(ActKind::Q8_0, &x, 1, 32, false);
        let r = a.row(0);
        assert_eq!(r.qs[0], 127);
        assert_eq!(r.qs[2], -127);
        assert_eq!(r.qs[1], 0);
        assert_eq!(r.qs[3], 2);
        assert_eq!(r.d[0], crate::kernels::tables::round_to_f16(2.54 / 127.0));
    }

    #[test]
    fn q8_1_sum_term_uses_unrounded_scale() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 * 0.25 - 3.0).collect();
        let a = ActRows::quantize(ActKind::Q8_1, &x, 1, 32, false);
        let r = a.row(0);
        let sum: i32 = r.qs.iter().map(|&q| q as i32).sum();
        let scale = 4.75f32 / 127.0;
        assert_eq!(
            r.s[0],
            crate::kernels::tables::round_to_f16(sum as f32 * scale)
        );
    }

    #[test]
    fn q8k_maps_signed_extreme_to_minus_127_and_sums_groups() {
        let mut x = vec![0.5f32; 512];
        x[3] = 4.0;
        let a = ActRows::quantize(ActKind::Q8K, &x, 2, 256, false);
        let r = a.row(0);
        assert_eq!(r.qs[3], -127);
        assert_eq!(r.d[0], -4.0 / 127.0);
        let expected: i16 = r.qs[0..16].iter().map(|&q| q as i16).sum();
        assert_eq!(r.bsums[0], expected);
        // Row 1 is independent of row 0.
        let r1 = a.row(1);
        assert_eq!(r1.qs[0], -127);
    }

    #[test]
    fn q8k_all_zero_block_has_zero_scale() {
        let x = vec![0.0f32; 256];
        let a = ActRows::quantize(ActKind::Q8K, &x, 1, 256, false);
        assert_eq!(a.row(0).d[0], 0.0);
        assert!(a.row(0).qs.iter().all(|&q| q == 0));
    }

    /// The AVX2 conversions must reproduce the scalar ones bit for bit (the kernels'
    /// integer sums are compared exactly against the reference).
    #[test]
    fn simd_conversion_matches_scalar() {
        if !crate::kernels::SimdLevel::Avx2.is_supported() {
            nextn_testdata::cpu_feature_missing("avx2", "the AVX2 activation conversions");
            return;
        }
        let mut state = 0x9e37_79b9u32;
        let mut x: Vec<f32> = (0..3 * 1024)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect();
        // Exact ties for Q8_0 (block 0: amax 127 so values k + 0.5 tie) and Q8_K (block
        // 1: max -127 so iscale = 1), equal magnitudes of both signs, a zero block, and
        // values that round differently in f16 and bf16.
        x[0] = 127.0;
        for (j, v) in x[1..32].iter_mut().enumerate() {
            *v = j as f32 - 15.5;
        }
        x[256] = -127.0;
        for (j, v) in x[257..300].iter_mut().enumerate() {
            *v = j as f32 * 0.5 - 10.0;
        }
        x[300] = 127.0;
        x[512..768].fill(0.0);
        x[1000] = 1.0 + 1.0 / 256.0;
        x[1001] = 1.0 + 1.0 / 2048.0;
        for kind in [
            ActKind::Q8_0,
            ActKind::Q8_1,
            ActKind::Q8K,
            ActKind::F16,
            ActKind::BF16,
        ] {
            let scalar = ActRows::quantize(kind, &x, 3, 1024, false);
            let simd = ActRows::quantize(kind, &x, 3, 1024, true);
            for i in 0..3 {
                let (a, b) = (scalar.row(i), simd.row(i));
                assert_eq!(a.qs, b.qs, "{kind:?} row {i}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a.d), bits(b.d), "{kind:?} row {i}");
                assert_eq!(bits(a.s), bits(b.s), "{kind:?} row {i}");
                assert_eq!(bits(a.dsum), bits(b.dsum), "{kind:?} row {i}");
                assert_eq!(a.bsums, b.bsums, "{kind:?} row {i}");
                assert_eq!(bits(a.f), bits(b.f), "{kind:?} row {i}");
            }
        }
    }
}
