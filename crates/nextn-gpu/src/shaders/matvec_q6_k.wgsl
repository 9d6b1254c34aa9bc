// Q6_K: w holds each super-block's 128 bytes of low nibbles (8 vec4), 64 bytes of high bit
// pairs (4 vec4) and 16 signed sub-block scales (1 vec4); the side array its f16 scale.
// A unit v is 16 bytes of low nibbles, ql[64h + 32t + 16k ..][..16] with h = v / 4,
// t = (v / 2) % 2, k = v % 2: the low nibbles are elements 128h + 32t + 16k + (0..16) of
// sub-block 8h + 2t + k, the high ones the elements 64 further of sub-block 8h + 2t + k + 4;
// their top bits are qh[32h + 16k ..][..16] at bits 2t and 2t + 4.

struct Unit {
    dl0: f32,
    dl1: f32,
    lo: vec4<u32>,
    hi: vec4<u32>,
}

struct XUnit {
    v: array<vec4<f32>, 8>,
}

fn type_init(lid: u32) {}

fn scale_i8(s: vec4<u32>, i: u32) -> f32 {
    return f32(bitcast<i32>(s[i >> 2u] << (24u - 8u * (i & 3u))) >> 24u);
}

fn load_unit(row: u32, u: u32) -> Unit {
    let g = row * p.bpr + (u >> 3u);
    let v = u & 7u;
    let h = v >> 2u;
    let t = (v >> 1u) & 1u;
    let k = v & 1u;
    let base = g * 13u;
    let ql = w[base + v];
    let qh = w[base + 8u + 2u * h + k];
    let sc = w[base + 12u];
    let d = half_at(p.aux_off, g);
    let sub = 8u * h + 2u * t + k;
    let m = vec4<u32>(0x0f0f0f0fu);
    let b = vec4<u32>(0x03030303u);
    let lo = (ql & m) | (((qh >> vec4<u32>(2u * t)) & b) << vec4<u32>(4u));
    let hi = ((ql >> vec4<u32>(4u)) & m) | (((qh >> vec4<u32>(2u * t + 4u)) & b) << vec4<u32>(4u));
    return Unit(d * scale_i8(sc, sub), d * scale_i8(sc, sub + 4u), lo, hi);
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let v = u & 7u;
    let c = xb + (u >> 3u) * 256u + (v >> 2u) * 128u + ((v >> 1u) & 1u) * 32u + (v & 1u) * 16u;
    return XUnit(array<vec4<f32>, 8>(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u),
        x4(c + 64u), x4(c + 68u), x4(c + 72u), x4(c + 76u)));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    let o = vec4<f32>(32.0);
    var s0 = dot4(u8x4(a.lo.x) - o, b.v[0], 0.0);
    s0 = dot4(u8x4(a.lo.y) - o, b.v[1], s0);
    s0 = dot4(u8x4(a.lo.z) - o, b.v[2], s0);
    s0 = dot4(u8x4(a.lo.w) - o, b.v[3], s0);
    var s1 = dot4(u8x4(a.hi.x) - o, b.v[4], 0.0);
    s1 = dot4(u8x4(a.hi.y) - o, b.v[5], s1);
    s1 = dot4(u8x4(a.hi.z) - o, b.v[6], s1);
    s1 = dot4(u8x4(a.hi.w) - o, b.v[7], s1);
    return fma(a.dl1, s1, fma(a.dl0, s0, acc));
}
