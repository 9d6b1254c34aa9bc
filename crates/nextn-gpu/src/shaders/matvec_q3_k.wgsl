// Q3_K: w holds each super-block's 32 bytes of high-bit masks (2 vec4) then its 64 bytes of
// 2-bit codes (4 vec4); the side arrays its 12 bytes of packed 6-bit scales (3 words) and its
// f16 scale. Bits 2s of byte l of qs[32h + 16k ..][..16] are the low bits of element
// 128h + 32s + 16k + l, of sub-block 8h + 2s + k; bit 4h + s of hmask[16k + l] is its high
// bit (clear: the code is 4 less). A unit is one vec4 of codes (v = 2h + k) and a pair of
// shifts s = 2e, 2e + 1: unit 2v + e.

struct Unit {
    dl0: f32,
    dl1: f32,
    c0: vec4<u32>,
    c1: vec4<u32>,
}

struct XUnit {
    v: array<vec4<f32>, 8>,
}

fn type_init(lid: u32) {}

// ggml's 6-bit Q3_K scale i (0..16) of the 12 bytes s0, s1, s2, minus 32.
fn q3k_scale(i: u32, s0: u32, s1: u32, s2: u32) -> i32 {
    let j = i & 7u;
    let lw = select(s0, s1, j >= 4u);
    let low = (byte_of(lw, j & 3u) >> (4u * (i >> 3u))) & 15u;
    let high = (byte_of(s2, i & 3u) >> (2u * (i >> 2u))) & 3u;
    return i32(low | (high << 4u)) - 32;
}

// The codes plus 4 (0..8) of shift s, high bits at bit hb of the mask.
fn q3k_codes(q: vec4<u32>, hm: vec4<u32>, s: u32, hb: u32) -> vec4<u32> {
    let low = (q >> vec4<u32>(2u * s)) & vec4<u32>(0x03030303u);
    let high = (hm >> vec4<u32>(hb)) & vec4<u32>(0x01010101u);
    return low | (high << vec4<u32>(2u));
}

fn load_unit(row: u32, u: u32) -> Unit {
    let g = row * p.bpr + (u >> 3u);
    let v = (u >> 1u) & 3u;
    let h = v >> 1u;
    let k = v & 1u;
    let s0 = 2u * (u & 1u);
    let sw0 = word(p.aux_off + 3u * g);
    let sw1 = word(p.aux_off + 3u * g + 1u);
    let sw2 = word(p.aux_off + 3u * g + 2u);
    let d = half_at(p.aux2_off, g);
    let sub0 = 8u * h + 2u * s0 + k;
    let q = w[g * 6u + 2u + v];
    let hm = w[g * 6u + k];
    return Unit(d * f32(q3k_scale(sub0, sw0, sw1, sw2)), d * f32(q3k_scale(sub0 + 2u, sw0, sw1, sw2)),
        q3k_codes(q, hm, s0, 4u * h + s0), q3k_codes(q, hm, s0 + 1u, 4u * h + s0 + 1u));
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let v = (u >> 1u) & 3u;
    let c = xb + (u >> 3u) * 256u + (v >> 1u) * 128u + (v & 1u) * 16u + (u & 1u) * 64u;
    return XUnit(array<vec4<f32>, 8>(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u),
        x4(c + 32u), x4(c + 36u), x4(c + 40u), x4(c + 44u)));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    let o = vec4<f32>(4.0);
    var s0 = dot4(u8x4(a.c0.x) - o, b.v[0], 0.0);
    s0 = dot4(u8x4(a.c0.y) - o, b.v[1], s0);
    s0 = dot4(u8x4(a.c0.z) - o, b.v[2], s0);
    s0 = dot4(u8x4(a.c0.w) - o, b.v[3], s0);
    var s1 = dot4(u8x4(a.c1.x) - o, b.v[4], 0.0);
    s1 = dot4(u8x4(a.c1.y) - o, b.v[5], s1);
    s1 = dot4(u8x4(a.c1.z) - o, b.v[6], s1);
    s1 = dot4(u8x4(a.c1.w) - o, b.v[7], s1);
    return fma(a.dl1, s1, fma(a.dl0, s0, acc));
}
