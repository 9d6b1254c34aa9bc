// Q4_K against Q8_K activations: a block is a super-block, its 128 bytes of nibbles (8 vec4) and
// a 16-byte head in the side array (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins).
// Sub-block j holds nibble j % 2 of qs[32 (j / 2) ..][..32]. Integer sums Σ sc_j Σq·a and
// Σ mn_j Σa over the super-block, then d_a d_w · isum - d_a dmin_w · msum.

const SUBS: u32 = 8u;
const HAS_MIN: bool = true;

struct Head {
    d: f32,
    dmin: f32,
    s0: u32,
    s1: u32,
    s2: u32,
    g: u32,
}

struct Sub {
    q0: vec4<u32>,
    q1: vec4<u32>,
    sc: i32,
    mn: i32,
}

// ggml's get_scale_min_k4 for sub-block j of the 12 bytes s0, s1, s2: (scale, min).
fn scale_min_k4(j: u32, s0: u32, s1: u32, s2: u32) -> vec2<u32> {
    let i = j & 3u;
    let low = vec2<u32>(byte_of(s0, i) & 63u, byte_of(s1, i) & 63u);
    let b2 = byte_of(s2, i);
    let high = vec2<u32>((b2 & 15u) | ((byte_of(s0, i) >> 6u) << 4u), (b2 >> 4u) | ((byte_of(s1, i) >> 6u) << 4u));
    return select(low, high, j >= 4u);
}

fn load_head(row: u32, u: u32) -> Head {
    let g = row * p.blocks + u;
    let h = w[(p.aux_off >> 2u) + g];
    let dm = unpack2x16float(h.x);
    return Head(dm.x, dm.y, h.y, h.z, h.w, g);
}

fn load_sub(row: u32, u: u32, j: u32, h: Head) -> Sub {
    let sm = scale_min_k4(j, h.s0, h.s1, h.s2);
    let base = h.g * 8u + (j >> 1u) * 2u;
    let sh = vec4<u32>(4u * (j & 1u));
    let m = vec4<u32>(0x0f0f0f0fu);
    return Sub((w[base] >> sh) & m, (w[base + 1u] >> sh) & m, i32(sm.x), i32(sm.y));
}

fn sub_dot(s: Sub, a0: vec4<u32>, a1: vec4<u32>, asum: i32) -> vec2<i32> {
    return vec2<i32>(s.sc * (dot16(s.q0, a0) + dot16(s.q1, a1)), s.mn * asum);
}

fn block_term(h: Head, ad: f32, isum: i32, msum: i32, acc: f32) -> f32 {
    let d = ad * h.d;
    let dmin = ad * h.dmin;
    return fma(-dmin, f32(msum), fma(d, f32(isum), acc));
}
