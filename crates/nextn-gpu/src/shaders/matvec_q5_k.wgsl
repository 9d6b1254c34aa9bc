// Q5_K: w holds each super-block's 32 bytes of fifth bits (2 vec4) then its 128 bytes of
// nibbles (8 vec4); the side array its 16-byte head as Q4_K. A unit is 16 bytes of nibbles
// laid out as Q4_K's, with the fifth bits qh[16h ..][..16], bits 2c and 2c + 1.

struct Unit {
    dl0: f32,
    ml0: f32,
    dl1: f32,
    ml1: f32,
    lo: vec4<u32>,
    hi: vec4<u32>,
}

struct XUnit {
    v: array<vec4<f32>, 8>,
}

fn type_init(lid: u32) {}

fn scale_min_k4(j: u32, s0: u32, s1: u32, s2: u32) -> vec2<u32> {
    let i = j & 3u;
    let low = vec2<u32>(byte_of(s0, i) & 63u, byte_of(s1, i) & 63u);
    let b2 = byte_of(s2, i);
    let high = vec2<u32>((b2 & 15u) | ((byte_of(s0, i) >> 6u) << 4u), (b2 >> 4u) | ((byte_of(s1, i) >> 6u) << 4u));
    return select(low, high, j >= 4u);
}

fn load_unit(row: u32, u: u32) -> Unit {
    let g = row * p.bpr + (u >> 3u);
    let j = u & 7u;
    let c2 = j & 6u;
    let head = w[(p.aux_off >> 2u) + g];
    let dm = unpack2x16float(head.x);
    let sm0 = scale_min_k4(c2, head.y, head.z, head.w);
    let sm1 = scale_min_k4(c2 + 1u, head.y, head.z, head.w);
    let qh = w[g * 10u + (j & 1u)];
    let q = w[g * 10u + 2u + j];
    let m = vec4<u32>(0x0f0f0f0fu);
    let b = vec4<u32>(0x01010101u);
    let lo = (q & m) | (((qh >> vec4<u32>(c2)) & b) << vec4<u32>(4u));
    let hi = ((q >> vec4<u32>(4u)) & m) | (((qh >> vec4<u32>(c2 + 1u)) & b) << vec4<u32>(4u));
    return Unit(dm.x * f32(sm0.x), dm.y * f32(sm0.y), dm.x * f32(sm1.x), dm.y * f32(sm1.y), lo, hi);
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let c = xb + (u >> 3u) * 256u + ((u >> 1u) & 3u) * 64u + (u & 1u) * 16u;
    return XUnit(array<vec4<f32>, 8>(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u),
        x4(c + 32u), x4(c + 36u), x4(c + 40u), x4(c + 44u)));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    var s0 = dot4(u8x4(a.lo.x), b.v[0], 0.0);
    s0 = dot4(u8x4(a.lo.y), b.v[1], s0);
    s0 = dot4(u8x4(a.lo.z), b.v[2], s0);
    s0 = dot4(u8x4(a.lo.w), b.v[3], s0);
    var s1 = dot4(u8x4(a.hi.x), b.v[4], 0.0);
    s1 = dot4(u8x4(a.hi.y), b.v[5], s1);
    s1 = dot4(u8x4(a.hi.z), b.v[6], s1);
    s1 = dot4(u8x4(a.hi.w), b.v[7], s1);
    let x0 = sum4(b.v[3], sum4(b.v[2], sum4(b.v[1], sum4(b.v[0], 0.0))));
    let x1 = sum4(b.v[7], sum4(b.v[6], sum4(b.v[5], sum4(b.v[4], 0.0))));
    let t = fma(-a.ml0, x0, fma(a.dl0, s0, acc));
    return fma(-a.ml1, x1, fma(a.dl1, s1, t));
}
