// Q6_K against Q8_K activations: a block is a super-block, its 128 bytes of low nibbles, 64 of
// high bit pairs and 16 signed scales (13 vec4), its f16 d in the side array. Sub-block
// j = 4n + c is elements 128n + 32c + (0..32): nibble c / 2 of ql[64n + 32 (c % 2) + l] and
// bits 2c of qh[32n + l], minus 32; its two 16-value groups take scales 2j and 2j + 1.
// Term: Σ sc_g Σq·a · (d_a · d_w), as nextn-quant's CPU kernel.

const SUBS: u32 = 8u;
const HAS_MIN: bool = false;

struct Head {
    d: f32,
    sc: vec4<u32>,
    g: u32,
}

struct Sub {
    q0: vec4<u32>,
    q1: vec4<u32>,
    sc0: i32,
    sc1: i32,
}

fn load_head(row: u32, u: u32) -> Head {
    let g = row * p.blocks + u;
    return Head(half_at(p.aux_off, g), w[g * 13u + 12u], g);
}

fn load_sub(row: u32, u: u32, j: u32, h: Head) -> Sub {
    let n = j >> 2u;
    let c = j & 3u;
    let ql = h.g * 13u + 4u * n + 2u * (c & 1u);
    let qh = h.g * 13u + 8u + 2u * n;
    let sl = vec4<u32>(4u * (c >> 1u));
    let shh = vec4<u32>(2u * c);
    let m = vec4<u32>(0x0f0f0f0fu);
    let m2 = vec4<u32>(0x03030303u);
    let four = vec4<u32>(4u);
    let q0 = minus32(((w[ql] >> sl) & m) | (((w[qh] >> shh) & m2) << four));
    let q1 = minus32(((w[ql + 1u] >> sl) & m) | (((w[qh + 1u] >> shh) & m2) << four));
    let sw = bitcast<i32>(h.sc[j >> 1u]);
    let at = 16u * (j & 1u);
    return Sub(q0, q1, (sw << (24u - at)) >> 24u, (sw << (16u - at)) >> 24u);
}

fn sub_dot(s: Sub, a0: vec4<u32>, a1: vec4<u32>, asum: i32) -> vec2<i32> {
    return vec2<i32>(s.sc0 * dot16(s.q0, a0) + s.sc1 * dot16(s.q1, a1), 0);
}

fn block_term(h: Head, ad: f32, isum: i32, msum: i32, acc: f32) -> f32 {
    return fma(f32(isum), ad * h.d, acc);
}
