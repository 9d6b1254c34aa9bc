//! Byte layouts of the ggml blocks, as `#[repr(C)]` structs made only of byte arrays.
//!
//! Every struct here has alignment 1, no padding, and accepts any bit pattern, so a slice of
//! them can be viewed in place over bytes straight from a memory-mapped GGUF file (whose
//! tensor data need not be aligned for us). Multi-byte scalars are stored little-endian as
//! ggml writes them; read them through the accessor methods (`d()`, `dmin()`, ...).
//!
//! Field order and sizes follow ggml-common.h; the size of each struct is checked against
//! `GgmlType::type_size` in the unit tests.

use super::float::{f16_to_f32, f32_to_f16};
use crate::QuantError;
use nextn_gguf::GgmlType;

/// Elements in a K-quant / IQ4_XS super-block.
pub const QK_K: usize = 256;
/// Elements in a legacy (Q4_0 ... Q8_0), IQ4_NL or MXFP4 block.
pub const QK32: usize = 32;
/// Bytes of packed 6-bit scales/mins in Q4_K and Q5_K, and of packed 6-bit scales in Q3_K.
pub const K_SCALE_SIZE: usize = 12;

mod sealed {
    pub trait Sealed {}
}

/// A block struct of this module: a fixed-size, alignment-1 view of one ggml block.
///
/// Sealed: only the structs of this module implement it, each of which is `#[repr(C)]`,
/// consists solely of `u8`/`i8` arrays (so any byte pattern is a valid value), and has
/// `size_of::<Self>() == BYTES` (checked at compile time below).
pub trait Block: sealed::Sealed + Copy + Sized + 'static {
    /// The ggml type this block belongs to.
    const TYPE: GgmlType;
    /// Elements (weights) per block.
    const ELEMS: usize;
    /// Bytes per block.
    const BYTES: usize;
}

/// Views `bytes` as a slice of blocks, without copying.
///
/// Fails with `SizeMismatch` when `bytes.len()` is not a multiple of the block size.
pub fn blocks_from_bytes<B: Block>(bytes: &[u8]) -> Result<&[B], QuantError> {
    let n = whole_blocks::<B>(bytes.len())?;
    // SAFETY: `B` is one of the structs below: alignment 1, size `B::BYTES`, every bit
    // pattern valid. `bytes` holds exactly `n * B::BYTES` initialised bytes that stay
    // borrowed (immutably) for the lifetime of the returned slice.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), n) })
}

/// Views `bytes` as a mutable slice of blocks, without copying.
pub fn blocks_from_bytes_mut<B: Block>(bytes: &mut [u8]) -> Result<&mut [B], QuantError> {
    let n = whole_blocks::<B>(bytes.len())?;
    // SAFETY: as in `blocks_from_bytes`; the exclusive borrow of `bytes` is moved into the
    // returned slice, and any value written through it is a valid byte pattern.
    Ok(unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<B>(), n) })
}

/// Views blocks as their bytes, without copying.
pub fn blocks_as_bytes<B: Block>(blocks: &[B]) -> &[u8] {
    // SAFETY: the structs have no padding, so all `len * BYTES` bytes are initialised.
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    }
}

fn whole_blocks<B: Block>(len: usize) -> Result<usize, QuantError> {
    if !len.is_multiple_of(B::BYTES) {
        return Err(QuantError::SizeMismatch {
            what: "block bytes (a multiple of the block size)",
            expected: len - len % B::BYTES + B::BYTES,
            got: len,
        });
    }
    Ok(len / B::BYTES)
}

macro_rules! block {
    ($(#[$doc:meta])* $name:ident, $ty:ident, $elems:expr, $bytes:expr,
     { $($(#[$fdoc:meta])* $field:ident : $fty:ty),+ $(,)? }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name {
            $($(#[$fdoc])* pub $field: $fty,)+
        }
        impl sealed::Sealed for $name {}
        impl Block for $name {
            const TYPE: GgmlType = GgmlType::$ty;
            const ELEMS: usize = $elems;
            const BYTES: usize = $bytes;
        }
        const _: () = assert!(std::mem::size_of::<$name>() == $bytes);
        const _: () = assert!(std::mem::align_of::<$name>() == 1);
        impl Default for $name {
            fn default() -> Self {
                // SAFETY: the struct is made of byte arrays only; all-zero bytes are a valid
                // value (a block of zeros with zero scale in every format).
                unsafe { std::mem::zeroed() }
            }
        }
    };
}

block!(
    /// Q4_0: `x = d * (q - 8)`, q a 4-bit code; element `j` (0..16) in the low nibble of
    /// `qs[j]`, element `j + 16` in its high nibble.
    BlockQ4_0, Q4_0, QK32, 18, {
    /// f16 scale.
    d: [u8; 2],
    qs: [u8; 16],
});

block!(
    /// Q4_1: `x = d * q + m`, q a 4-bit code packed like Q4_0.
    BlockQ4_1, Q4_1, QK32, 20, {
    /// f16 scale.
    d: [u8; 2],
    /// f16 offset (the block minimum).
    m: [u8; 2],
    qs: [u8; 16],
});

block!(
    /// Q5_0: `x = d * (q - 16)`; low 4 bits of q packed like Q4_0, bit 4 of element `j` is
    /// bit `j` of the little-endian u32 `qh`.
    BlockQ5_0, Q5_0, QK32, 22, {
    /// f16 scale.
    d: [u8; 2],
    qh: [u8; 4],
    qs: [u8; 16],
});

block!(
    /// Q5_1: `x = d * q + m`, q packed like Q5_0.
    BlockQ5_1, Q5_1, QK32, 24, {
    /// f16 scale.
    d: [u8; 2],
    /// f16 offset (the block minimum).
    m: [u8; 2],
    qh: [u8; 4],
    qs: [u8; 16],
});

block!(
    /// Q8_0: `x = d * q`, q a signed byte.
    BlockQ8_0, Q8_0, QK32, 34, {
    /// f16 scale.
    d: [u8; 2],
    qs: [i8; 32],
});

block!(
    /// Q2_K: 16 sub-blocks of 16; `x = d*(sc&15) * q - dmin*(sc>>4)`, q 2-bit.
    /// Element `j` = `128*h + 32*s + l` has q = `(qs[32*h + l] >> 2*s) & 3` and sub-block `j/16`.
    BlockQ2K, Q2_K, QK_K, 84, {
    /// Per sub-block: low nibble scale, high nibble min.
    scales: [u8; 16],
    qs: [u8; 64],
    /// f16 super-block scale of the scales.
    d: [u8; 2],
    /// f16 super-block scale of the mins.
    dmin: [u8; 2],
});

block!(
    /// Q3_K: 16 sub-blocks of 16; `x = d*(sc - 32) * (q - 4*(1 - hbit))`.
    /// Element `j` = `128*h + 32*s + l`: low bits `(qs[32*h + l] >> 2*s) & 3`,
    /// high bit `(hmask[j % 32] >> (j / 32)) & 1`. Scales: see [`q3k_scale`](super::tables::q3k_scale).
    BlockQ3K, Q3_K, QK_K, 110, {
    hmask: [u8; 32],
    qs: [u8; 64],
    /// 16 packed 6-bit scales.
    scales: [u8; K_SCALE_SIZE],
    /// f16 super-block scale.
    d: [u8; 2],
});

block!(
    /// Q4_K: 8 sub-blocks of 32; `x = (d*sc) * q - (dmin*m)`, (sc, m) from
    /// [`get_scale_min_k4`](super::tables::get_scale_min_k4). Element `j` = `64*c + 32*s + l`
    /// has q = `(qs[32*c + l] >> 4*s) & 15` and sub-block `j/32`.
    BlockQ4K, Q4_K, QK_K, 144, {
    /// f16 super-block scale of the scales.
    d: [u8; 2],
    /// f16 super-block scale of the mins.
    dmin: [u8; 2],
    /// 8 packed 6-bit scales and 8 packed 6-bit mins.
    scales: [u8; K_SCALE_SIZE],
    qs: [u8; 128],
});

block!(
    /// Q5_K: as Q4_K, plus a fifth bit per element: bit 4 of element `j` is
    /// `(qh[j % 32] >> (j / 32)) & 1`.
    BlockQ5K, Q5_K, QK_K, 176, {
    /// f16 super-block scale of the scales.
    d: [u8; 2],
    /// f16 super-block scale of the mins.
    dmin: [u8; 2],
    scales: [u8; K_SCALE_SIZE],
    qh: [u8; 32],
    qs: [u8; 128],
});

block!(
    /// Q6_K: 16 sub-blocks of 16; `x = (d*scales[j/16]) * (q - 32)`.
    /// Element `j` = `128*h + 32*s + l` (s in 0..4): low 4 bits
    /// `(ql[64*h + 32*(s&1) + l] >> 4*(s>>1)) & 15`, high 2 bits `(qh[32*h + l] >> 2*s) & 3`.
    BlockQ6K, Q6_K, QK_K, 210, {
    ql: [u8; 128],
    qh: [u8; 64],
    /// Signed 8-bit sub-block scales.
    scales: [i8; 16],
    /// f16 super-block scale.
    d: [u8; 2],
});

block!(
    /// Q8_K (activation format): `x = d * q`; `bsums[i]` is the sum of `qs[16*i .. 16*i + 16]`.
    BlockQ8K, Q8_K, QK_K, 292, {
    /// f32 scale (little-endian).
    d: [u8; 4],
    qs: [i8; 256],
    /// 16 little-endian i16 sums of 16 quants each.
    bsums: [u8; 32],
});

block!(
    /// IQ4_NL: `x = d * KVALUES_IQ4NL[q]`, q packed like Q4_0.
    BlockIQ4NL, IQ4_NL, QK32, 18, {
    /// f16 scale.
    d: [u8; 2],
    qs: [u8; 16],
});

block!(
    /// IQ4_XS: 8 sub-blocks of 32; `x = (d*(sc - 32)) * KVALUES_IQ4NL[q]`, sc 6-bit:
    /// low 4 bits `(scales_l[ib/2] >> 4*(ib%2)) & 15`, high 2 bits `(scales_h >> 2*ib) & 3`.
    /// Sub-block `ib` element `k` = `16*s + l` has q = `(qs[16*ib + l] >> 4*s) & 15`.
    BlockIQ4XS, IQ4_XS, QK_K, 136, {
    /// f16 super-block scale.
    d: [u8; 2],
    /// Little-endian u16 of the 2 high bits of each of the 8 scales.
    scales_h: [u8; 2],
    scales_l: [u8; 4],
    qs: [u8; 128],
});

block!(
    /// MXFP4: `x = e8m0_half(e) * KVALUES_MXFP4[q]` (the table holds doubled e2m1 values,
    /// the scale is halved to match), q packed like Q4_0.
    BlockMxfp4, MXFP4, QK32, 17, {
    /// E8M0 shared exponent.
    e: [u8; 1],
    qs: [u8; 16],
});

macro_rules! f16_field {
    ($name:ident, $get:ident, $set:ident, $field:ident) => {
        impl $name {
            #[inline]
            pub fn $get(&self) -> f32 {
                f16_to_f32(u16::from_le_bytes(self.$field))
            }
            /// Stores `v` rounded to f16 (nearest, ties to even).
            #[inline]
            pub fn $set(&mut self, v: f32) {
                self.$field = f32_to_f16(v).to_le_bytes();
            }
        }
    };
}

f16_field!(BlockQ4_0, d, set_d, d);
f16_field!(BlockQ4_1, d, set_d, d);
f16_field!(BlockQ4_1, m, set_m, m);
f16_field!(BlockQ5_0, d, set_d, d);
f16_field!(BlockQ5_1, d, set_d, d);
f16_field!(BlockQ5_1, m, set_m, m);
f16_field!(BlockQ8_0, d, set_d, d);
f16_field!(BlockQ2K, d, set_d, d);
f16_field!(BlockQ2K, dmin, set_dmin, dmin);
f16_field!(BlockQ3K, d, set_d, d);
f16_field!(BlockQ4K, d, set_d, d);
f16_field!(BlockQ4K, dmin, set_dmin, dmin);
f16_field!(BlockQ5K, d, set_d, d);
f16_field!(BlockQ5K, dmin, set_dmin, dmin);
f16_field!(BlockQ6K, d, set_d, d);
f16_field!(BlockIQ4NL, d, set_d, d);
f16_field!(BlockIQ4XS, d, set_d, d);

impl BlockQ5_0 {
    /// The 32 fifth bits, bit `j` for element `j`.
    #[inline]
    pub fn qh(&self) -> u32 {
        u32::from_le_bytes(self.qh)
    }
}

impl BlockQ5_1 {
    /// The 32 fifth bits, bit `j` for element `j`.
    #[inline]
    pub fn qh(&self) -> u32 {
        u32::from_le_bytes(self.qh)
    }
}

impl BlockQ8K {
    #[inline]
    pub fn d(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
    #[inline]
    pub fn set_d(&mut self, v: f32) {
        self.d = v.to_le_bytes();
    }
    /// Sum of `qs[16*i .. 16*i + 16]`.
    #[inline]
    pub fn bsum(&self, i: usize) -> i16 {
        i16::from_le_bytes([self.bsums[2 * i], self.bsums[2 * i + 1]])
    }
    #[inline]
    pub fn set_bsum(&mut self, i: usize, v: i16) {
        self.bsums[2 * i..2 * i + 2].copy_from_slice(&v.to_le_bytes());
    }
}

impl BlockIQ4XS {
    /// The 16 high scale bits (2 per sub-block).
    #[inline]
    pub fn scales_h(&self) -> u16 {
        u16::from_le_bytes(self.scales_h)
    }
}

impl BlockMxfp4 {
    /// The shared scale, halved (see [`e8m0_to_f32_half`](super::tables::e8m0_to_f32_half)).
    #[inline]
    pub fn d_half(&self) -> f32 {
        super::tables::e8m0_to_f32_half(self.e[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<B: Block>() {
        assert_eq!(B::TYPE.type_size(), B::BYTES, "{}", B::TYPE);
        assert_eq!(B::TYPE.block_size(), B::ELEMS, "{}", B::TYPE);
        assert_eq!(std::mem::size_of::<B>(), B::BYTES);
    }

    #[test]
    fn sizes_match_ggml() {
        check::<BlockQ4_0>();
        check::<BlockQ4_1>();
        check::<BlockQ5_0>();
        check::<BlockQ5_1>();
        check::<BlockQ8_0>();
        check::<BlockQ2K>();
        check::<BlockQ3K>();
        check::<BlockQ4K>();
        check::<BlockQ5K>();
        check::<BlockQ6K>();
        check::<BlockQ8K>();
        check::<BlockIQ4NL>();
        check::<BlockIQ4XS>();
        check::<BlockMxfp4>();
    }

    #[test]
    fn views_in_place_and_reject_partial_blocks() {
        let mut bytes = vec![0u8; 2 * 34];
        bytes[34] = 0x00;
        bytes[35] = 0x3c; // f16 1.0
        bytes[36] = 0xff; // qs[0] = -1
        let blocks: &[BlockQ8_0] = blocks_from_bytes(&bytes).unwrap();
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[1].d(), 1.0);
        assert_eq!(blocks[1].qs[0], -1);
        assert_eq!(blocks_as_bytes(blocks), &bytes[..]);
        let err = blocks_from_bytes::<BlockQ8_0>(&bytes[..35]).unwrap_err();
        assert!(
            matches!(
                err,
                QuantError::SizeMismatch {
                    got: 35,
                    expected: 68,
                    ..
                }
            ),
            "{err}"
        );
        let mut q8k_bytes = [0u8; 292];
        let mut_blocks: &mut [BlockQ8K] = blocks_from_bytes_mut(&mut q8k_bytes).unwrap();
        mut_blocks[0].set_bsum(15, -300);
        assert_eq!(mut_blocks[0].bsum(15), -300);
    }
}
