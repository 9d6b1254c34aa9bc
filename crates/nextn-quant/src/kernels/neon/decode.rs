//! NEON unpacking of a weight row into a `DecodedRow`. Unlike the x86 layout, weights are
//! stored as their true signed values (NEON multiplies signed by signed), K-family
//! sub-block scales are one i16 per 16 weights in `sc`, and only types with a separate
//! `dmin` (Q2_K, Q4_K, Q5_K) fill `mins`.

use core::arch::aarch64::*;

use super::super::decoded_row::DecodedRow;
use super::super::tables::{
    e8m0_to_f32_half, f16_bits_to_f32, iq4xs_scales, k4_scales_mins_packed, q3k_scales_packed,
    read_f16, read_f32, read_u32, KVALUES_IQ4NL, KVALUES_MXFP4,
};

#[inline]
unsafe fn store(st: &mut DecodedRow, at: usize, v: int8x16_t) {
    // SAFETY: NEON is part of every aarch64 CPU; `at` names a chunk inside the decoded row `st`,
    // which the decoder sized for the whole row (debug-asserted below).
    unsafe {
        debug_assert!(st.q.len() >= at + 16);
        vst1q_s8(st.q.as_mut_ptr().add(at) as *mut i8, v);
    }
}

/// 16 packed bytes: (low nibbles, high nibbles), each 16 lanes.
#[inline]
unsafe fn nibbles(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: NEON is part of every aarch64 CPU; `p` points at as many valid elements as the loads
    // below read (the callers pass whole blocks or rows).
    unsafe {
        let v = vld1q_u8(p);
        (vandq_u8(v, vdupq_n_u8(0x0f)), vshrq_n_u8::<4>(v))
    }
}

/// Bit j of `bits` as byte j (0xFF when set): (bytes 0..16, bytes 16..32).
#[inline]
unsafe fn bits_to_bytes(bits: u32) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: NEON is part of every aarch64 CPU.
    unsafe {
        let src = vreinterpretq_u8_u32(vdupq_n_u32(bits));
        const LO: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
        const HI: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];
        const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
        let bit = vld1q_u8(BIT.as_ptr());
        (
            vtstq_u8(vqtbl1q_u8(src, vld1q_u8(LO.as_ptr())), bit),
            vtstq_u8(vqtbl1q_u8(src, vld1q_u8(HI.as_ptr())), bit),
        )
    }
}

#[inline]
fn check(w: &[u8], st: &DecodedRow, nb: usize, bytes: usize) {
    debug_assert!(w.len() >= nb * bytes && st.d.len() >= nb && st.m.len() >= nb);
}

/// 4-bit blocks whose quants start `qs_at` bytes into each block: lanes `lut[nibble]`, or
/// `nibble - offset` without a table.
#[inline]
unsafe fn decode_nibble_blocks(
    w: &[u8],
    st: &mut DecodedRow,
    nb: usize,
    bytes: usize,
    qs_at: usize,
    lut: Option<&[i8; 16]>,
    offset: i8,
) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them.
    unsafe {
        for b in 0..nb {
            let p = w.as_ptr().add(bytes * b + qs_at);
            let (lo, hi) = nibbles(p);
            let (lo, hi) = match lut {
                Some(t) => {
                    let t = vld1q_s8(t.as_ptr());
                    (vqtbl1q_s8(t, lo), vqtbl1q_s8(t, hi))
                }
                None => {
                    let o = vdupq_n_s8(offset);
                    (
                        vsubq_s8(vreinterpretq_s8_u8(lo), o),
                        vsubq_s8(vreinterpretq_s8_u8(hi), o),
                    )
                }
            };
            store(st, 32 * b, lo);
            store(st, 32 * b + 16, hi);
        }
    }
}

pub(super) unsafe fn decode_q4_0(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 18);
        for b in 0..nb {
            st.d[b] = read_f16(w, 18 * b);
        }
        decode_nibble_blocks(w, st, nb, 18, 2, None, 8);
    }
}

pub(super) unsafe fn decode_q4_1(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 20);
        for b in 0..nb {
            st.d[b] = read_f16(w, 20 * b);
            st.m[b] = read_f16(w, 20 * b + 2);
        }
        decode_nibble_blocks(w, st, nb, 20, 4, None, 0);
    }
}

pub(super) unsafe fn decode_iq4_nl(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 18);
        for b in 0..nb {
            st.d[b] = read_f16(w, 18 * b);
        }
        decode_nibble_blocks(w, st, nb, 18, 2, Some(&KVALUES_IQ4NL), 0);
    }
}

pub(super) unsafe fn decode_mxfp4(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 17);
        for b in 0..nb {
            st.d[b] = e8m0_to_f32_half(w[17 * b]);
        }
        decode_nibble_blocks(w, st, nb, 17, 1, Some(&KVALUES_MXFP4), 0);
    }
}

/// Q5_0 (`offset` 16) and Q5_1 (0): nibble | h<<4 - offset.
#[inline]
unsafe fn decode_q5(
    w: &[u8],
    st: &mut DecodedRow,
    nb: usize,
    bytes: usize,
    qh_at: usize,
    offset: i8,
) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them.
    unsafe {
        let bit4 = vdupq_n_u8(0x10);
        let o = vdupq_n_s8(offset);
        for b in 0..nb {
            let (lo, hi) = nibbles(w.as_ptr().add(bytes * b + qh_at + 4));
            let (h0, h1) = bits_to_bytes(read_u32(w, bytes * b + qh_at));
            let v0 = vorrq_u8(lo, vandq_u8(h0, bit4));
            let v1 = vorrq_u8(hi, vandq_u8(h1, bit4));
            store(st, 32 * b, vsubq_s8(vreinterpretq_s8_u8(v0), o));
            store(st, 32 * b + 16, vsubq_s8(vreinterpretq_s8_u8(v1), o));
        }
    }
}

pub(super) unsafe fn decode_q5_0(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 22);
        for b in 0..nb {
            st.d[b] = read_f16(w, 22 * b);
        }
        decode_q5(w, st, nb, 22, 2, 16);
    }
}

pub(super) unsafe fn decode_q5_1(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 24);
        for b in 0..nb {
            st.d[b] = read_f16(w, 24 * b);
            st.m[b] = read_f16(w, 24 * b + 2);
        }
        decode_q5(w, st, nb, 24, 4, 0);
    }
}

pub(super) unsafe fn decode_q8_0(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 34);
        for b in 0..nb {
            st.d[b] = read_f16(w, 34 * b);
            let p = w.as_ptr().add(34 * b + 2) as *const i8;
            store(st, 32 * b, vld1q_s8(p));
            store(st, 32 * b + 16, vld1q_s8(p.add(16)));
        }
    }
}

/// Bits `shift..shift+2` of each byte.
#[inline]
unsafe fn two_bits(v: uint8x16_t, shift: usize) -> uint8x16_t {
    // SAFETY: NEON is part of every aarch64 CPU.
    unsafe { vandq_u8(vshlq_u8(v, vdupq_n_s8(-(shift as i8))), vdupq_n_u8(3)) }
}

pub(super) unsafe fn decode_q2_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 84);
        for b in 0..nb {
            let blk = &w[84 * b..84 * b + 84];
            st.d[b] = read_f16(blk, 80);
            st.m[b] = read_f16(blk, 82);
            for (g, &packed) in blk[..16].iter().enumerate() {
                st.sc[16 * b + g] = (packed & 0x0f) as i16;
                st.mins[16 * b + g] = (packed >> 4) as i16;
            }
            for k in 0..2 {
                for half in 0..2 {
                    let q = vld1q_u8(blk.as_ptr().add(16 + 32 * k + 16 * half));
                    for j in 0..4 {
                        let at = 256 * b + 128 * k + 32 * j + 16 * half;
                        store(st, at, vreinterpretq_s8_u8(two_bits(q, 2 * j)));
                    }
                }
            }
        }
    }
}

pub(super) unsafe fn decode_q3_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 110);
        let four = vdupq_n_s8(4);
        for b in 0..nb {
            let blk = &w[110 * b..110 * b + 110];
            st.d[b] = read_f16(blk, 108);
            let sc = q3k_scales_packed(&blk[96..108]);
            for (o, &s) in st.sc[16 * b..16 * b + 16].iter_mut().zip(&sc) {
                *o = s as i16 - 32;
            }
            for half in 0..2 {
                let hmask = vld1q_u8(blk.as_ptr().add(16 * half));
                for k in 0..2 {
                    let q = vld1q_u8(blk.as_ptr().add(32 + 32 * k + 16 * half));
                    for j in 0..4 {
                        let low = vreinterpretq_s8_u8(two_bits(q, 2 * j));
                        // A clear high bit means "subtract 4".
                        let set = vtstq_u8(hmask, vdupq_n_u8(1 << (4 * k + j)));
                        let sub = vbicq_s8(four, vreinterpretq_s8_u8(set));
                        store(
                            st,
                            256 * b + 128 * k + 32 * j + 16 * half,
                            vsubq_s8(low, sub),
                        );
                    }
                }
            }
        }
    }
}

/// Q4_K / Q5_K header: d, dmin, one scale per 16 (each 32-scale twice), mins likewise.
#[inline]
fn k4_header(blk: &[u8], st: &mut DecodedRow, b: usize) {
    st.d[b] = read_f16(blk, 0);
    st.m[b] = read_f16(blk, 2);
    let (sc, mn) = k4_scales_mins_packed(&blk[4..16]);
    let (sc, mn) = (sc.to_le_bytes(), mn.to_le_bytes());
    for g in 0..16 {
        st.sc[16 * b + g] = sc[g / 2] as i16;
        st.mins[16 * b + g] = mn[g / 2] as i16;
    }
}

pub(super) unsafe fn decode_q4_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 144);
        for b in 0..nb {
            let blk = &w[144 * b..144 * b + 144];
            k4_header(blk, st, b);
            for j in 0..4 {
                for half in 0..2 {
                    let (lo, hi) = nibbles(blk.as_ptr().add(16 + 32 * j + 16 * half));
                    store(st, 256 * b + 64 * j + 16 * half, vreinterpretq_s8_u8(lo));
                    store(
                        st,
                        256 * b + 64 * j + 32 + 16 * half,
                        vreinterpretq_s8_u8(hi),
                    );
                }
            }
        }
    }
}

pub(super) unsafe fn decode_q5_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 176);
        let bit4 = vdupq_n_u8(0x10);
        for b in 0..nb {
            let blk = &w[176 * b..176 * b + 176];
            k4_header(blk, st, b);
            for half in 0..2 {
                let qh = vld1q_u8(blk.as_ptr().add(16 + 16 * half));
                for j in 0..4 {
                    let (lo, hi) = nibbles(blk.as_ptr().add(48 + 32 * j + 16 * half));
                    for (h, low) in [lo, hi].into_iter().enumerate() {
                        let s = 2 * j + h;
                        let high = vandq_u8(vtstq_u8(qh, vdupq_n_u8(1 << s)), bit4);
                        store(
                            st,
                            256 * b + 32 * s + 16 * half,
                            vreinterpretq_s8_u8(vorrq_u8(low, high)),
                        );
                    }
                }
            }
        }
    }
}

pub(super) unsafe fn decode_q6_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 210);
        let m4 = vdupq_n_u8(0x0f);
        let m2 = vdupq_n_u8(3);
        let off = vdupq_n_s8(32);
        for b in 0..nb {
            let blk = &w[210 * b..210 * b + 210];
            st.d[b] = read_f16(blk, 208);
            for g in 0..16 {
                st.sc[16 * b + g] = blk[192 + g] as i8 as i16;
            }
            for n in 0..2 {
                for half in 0..2 {
                    let a = vld1q_u8(blk.as_ptr().add(64 * n + 16 * half));
                    let c = vld1q_u8(blk.as_ptr().add(64 * n + 32 + 16 * half));
                    let h = vld1q_u8(blk.as_ptr().add(128 + 32 * n + 16 * half));
                    let highs = [
                        vandq_u8(h, m2),
                        vandq_u8(vshrq_n_u8::<2>(h), m2),
                        vandq_u8(vshrq_n_u8::<4>(h), m2),
                        vshrq_n_u8::<6>(h),
                    ];
                    let lows = [
                        vandq_u8(a, m4),
                        vandq_u8(c, m4),
                        vshrq_n_u8::<4>(a),
                        vshrq_n_u8::<4>(c),
                    ];
                    for k in 0..4 {
                        let v = vorrq_u8(lows[k], vshlq_n_u8::<4>(highs[k]));
                        store(
                            st,
                            256 * b + 128 * n + 32 * k + 16 * half,
                            vsubq_s8(vreinterpretq_s8_u8(v), off),
                        );
                    }
                }
            }
        }
    }
}

pub(super) unsafe fn decode_q8_k(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 292);
        for b in 0..nb {
            st.d[b] = read_f32(w, 292 * b);
            for g in 0..16 {
                st.sc[16 * b + g] = 1;
                store(
                    st,
                    256 * b + 16 * g,
                    vld1q_s8(w.as_ptr().add(292 * b + 4 + 16 * g) as *const i8),
                );
            }
        }
    }
}

pub(super) unsafe fn decode_iq4_xs(w: &[u8], st: &mut DecodedRow, nb: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `nb` whole blocks and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        check(w, st, nb, 136);
        let table = vld1q_s8(KVALUES_IQ4NL.as_ptr());
        for b in 0..nb {
            let blk = &w[136 * b..136 * b + 136];
            st.d[b] = read_f16(blk, 0);
            let ls = iq4xs_scales(u16::from_le_bytes([blk[2], blk[3]]), &blk[4..8]);
            for (ib, &scale) in ls.iter().enumerate() {
                st.sc[16 * b + 2 * ib] = scale as i16;
                st.sc[16 * b + 2 * ib + 1] = scale as i16;
                let (lo, hi) = nibbles(blk.as_ptr().add(8 + 16 * ib));
                store(st, 256 * b + 32 * ib, vqtbl1q_s8(table, lo));
                store(st, 256 * b + 32 * ib + 16, vqtbl1q_s8(table, hi));
            }
        }
    }
}

pub(super) unsafe fn decode_f16(w: &[u8], st: &mut DecodedRow, n: usize) {
    debug_assert!(w.len() >= 2 * n && st.f.len() >= n);
    for (j, o) in st.f[..n].iter_mut().enumerate() {
        *o = f16_bits_to_f32(u16::from_le_bytes([w[2 * j], w[2 * j + 1]]));
    }
}

pub(super) unsafe fn decode_bf16(w: &[u8], st: &mut DecodedRow, n: usize) {
    // SAFETY: NEON is part of every aarch64 CPU; `w` holds `n` whole elements and `st` was made for
    // this type and width, so every load from `w` and store into `st` stays inside them
    // (debug-checked where cheap).
    unsafe {
        debug_assert!(w.len() >= 2 * n && st.f.len() >= n);
        let (src, dst) = (w.as_ptr(), st.f.as_mut_ptr());
        let mut j = 0;
        while j + 4 <= n {
            // Byte loads: the row has no alignment guarantee.
            let h = vreinterpret_u16_u8(vld1_u8(src.add(2 * j)));
            vst1q_f32(dst.add(j), vreinterpretq_f32_u32(vshll_n_u16::<16>(h)));
            j += 4;
        }
        while j < n {
            let bits = u16::from_le_bytes([*src.add(2 * j), *src.add(2 * j + 1)]);
            *dst.add(j) = f32::from_bits((bits as u32) << 16);
            j += 1;
        }
    }
}

pub(super) unsafe fn decode_none(_w: &[u8], _st: &mut DecodedRow, _n: usize) {}
