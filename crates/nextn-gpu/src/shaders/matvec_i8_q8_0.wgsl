// Q8_0 against Q8_0 activations: a block is one sub-block of 32 signed bytes (2 vec4), its scale
// the f16 in the side array. Term: Σq·a · (d_w · d_a), as nextn-quant's CPU kernel.

const SUBS: u32 = 1u;
const HAS_MIN: bool = false;

struct Head {
    d: f32,
    g: u32,
}

struct Sub {
    q0: vec4<u32>,
    q1: vec4<u32>,
}

fn load_head(row: u32, u: u32) -> Head {
    let g = row * p.blocks + u;
    return Head(half_at(p.aux_off, g), g);
}

fn load_sub(row: u32, u: u32, j: u32, h: Head) -> Sub {
    return Sub(w[h.g * 2u], w[h.g * 2u + 1u]);
}

fn sub_dot(s: Sub, a0: vec4<u32>, a1: vec4<u32>, asum: i32) -> vec2<i32> {
    return vec2<i32>(dot16(s.q0, a0) + dot16(s.q1, a1), 0);
}

fn block_term(h: Head, ad: f32, isum: i32, msum: i32, acc: f32) -> f32 {
    return fma(f32(isum), h.d * ad, acc);
}
