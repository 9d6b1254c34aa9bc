// Q2_K: w holds each super-block's 16 scale bytes (1 vec4) then its 64 bytes of 2-bit codes
// (4 vec4); the side array its f16 d and f16 dmin in one word. Bits 2s of byte l of
// qs[32h + 16k ..][..16] are element 128h + 32s + 16k + l, of sub-block 8h + 2s + k. A unit
// is one such vec4 of codes (v = 2h + k) and a pair of shifts s = 2e, 2e + 1: unit 2v + e.

struct Unit {
    dl0: f32,
    ml0: f32,
    dl1: f32,
    ml1: f32,
    c0: vec4<u32>,
    c1: vec4<u32>,
}

struct XUnit {
    v: array<vec4<f32>, 8>,
}

fn type_init(lid: u32) {}

fn load_unit(row: u32, u: u32) -> Unit {
    let g = row * p.bpr + (u >> 3u);
    let v = (u >> 1u) & 3u;
    let s0 = 2u * (u & 1u);
    let sub0 = 8u * (v >> 1u) + 2u * s0 + (v & 1u);
    let scales = w[g * 5u];
    // Sub-blocks sub0 and sub0 + 2 are bytes of the same word.
    let sw = scales[sub0 >> 2u];
    let sc0 = byte_of(sw, sub0 & 3u);
    let sc1 = byte_of(sw, (sub0 & 3u) + 2u);
    let dm = unpack2x16float(word(p.aux_off + g));
    let q = w[g * 5u + 1u + v];
    let m = vec4<u32>(0x03030303u);
    return Unit(dm.x * f32(sc0 & 15u), dm.y * f32(sc0 >> 4u), dm.x * f32(sc1 & 15u), dm.y * f32(sc1 >> 4u),
        (q >> vec4<u32>(2u * s0)) & m, (q >> vec4<u32>(2u * s0 + 2u)) & m);
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let v = (u >> 1u) & 3u;
    let c = xb + (u >> 3u) * 256u + (v >> 1u) * 128u + (v & 1u) * 16u + (u & 1u) * 64u;
    return XUnit(array<vec4<f32>, 8>(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u),
        x4(c + 32u), x4(c + 36u), x4(c + 40u), x4(c + 44u)));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    var s0 = dot4(u8x4(a.c0.x), b.v[0], 0.0);
    s0 = dot4(u8x4(a.c0.y), b.v[1], s0);
    s0 = dot4(u8x4(a.c0.z), b.v[2], s0);
    s0 = dot4(u8x4(a.c0.w), b.v[3], s0);
    var s1 = dot4(u8x4(a.c1.x), b.v[4], 0.0);
    s1 = dot4(u8x4(a.c1.y), b.v[5], s1);
    s1 = dot4(u8x4(a.c1.z), b.v[6], s1);
    s1 = dot4(u8x4(a.c1.w), b.v[7], s1);
    let x0 = sum4(b.v[3], sum4(b.v[2], sum4(b.v[1], sum4(b.v[0], 0.0))));
    let x1 = sum4(b.v[7], sum4(b.v[6], sum4(b.v[5], sum4(b.v[4], 0.0))));
    // Scale before min: with a single non-zero x this is exactly ggml's dl * q - ml.
    let t = fma(-a.ml0, x0, fma(a.dl0, s0, acc));
    return fma(-a.ml1, x1, fma(a.dl1, s1, t));
}
