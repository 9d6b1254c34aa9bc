//! F32 / F16 / BF16 weights: products in f32, summed in f64 like ggml's generic path.

use super::super::act::ActRow;
use super::super::tables::{bf16_bits_to_f32, f16_bits_to_f32, read_f32};

pub(super) fn dot_f32(w: &[u8], a: &ActRow) -> f32 {
    let mut sum = 0f64;
    for (j, &x) in a.f.iter().enumerate() {
        sum += (read_f32(w, 4 * j) * x) as f64;
    }
    sum as f32
}

pub(super) fn dot_f16(w: &[u8], a: &ActRow) -> f32 {
    let mut sum = 0f64;
    for (j, &x) in a.f.iter().enumerate() {
        let wv = f16_bits_to_f32(u16::from_le_bytes([w[2 * j], w[2 * j + 1]]));
        sum += (wv * x) as f64;
    }
    sum as f32
}

pub(super) fn dot_bf16(w: &[u8], a: &ActRow) -> f32 {
    let mut sum = 0f64;
    for (j, &x) in a.f.iter().enumerate() {
        let wv = bf16_bits_to_f32(u16::from_le_bytes([w[2 * j], w[2 * j + 1]]));
        sum += (wv * x) as f64;
    }
    sum as f32
}
