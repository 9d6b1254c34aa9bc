// Q4_0: w holds each block's 16 bytes of nibbles (one vec4), the side array its f16 scale.
// A unit is one block: elements 0..16 in the low nibbles, 16..32 in the high ones.

struct Unit {
    d: f32,
    lo: vec4<u32>,
    hi: vec4<u32>,
}

struct XUnit {
    v: array<vec4<f32>, 8>,
}

fn type_init(lid: u32) {}

fn load_unit(row: u32, u: u32) -> Unit {
    let g = row * p.bpr + u;
    let q = w[g];
    return Unit(half_at(p.aux_off, g), q & vec4<u32>(0x0f0f0f0fu), (q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu));
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let c = xb + u * 32u;
    return XUnit(array<vec4<f32>, 8>(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u),
        x4(c + 16u), x4(c + 20u), x4(c + 24u), x4(c + 28u)));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    let o = vec4<f32>(8.0);
    var s = dot4(u8x4(a.lo.x) - o, b.v[0], 0.0);
    s = dot4(u8x4(a.lo.y) - o, b.v[1], s);
    s = dot4(u8x4(a.lo.z) - o, b.v[2], s);
    s = dot4(u8x4(a.lo.w) - o, b.v[3], s);
    s = dot4(u8x4(a.hi.x) - o, b.v[4], s);
    s = dot4(u8x4(a.hi.y) - o, b.v[5], s);
    s = dot4(u8x4(a.hi.z) - o, b.v[6], s);
    s = dot4(u8x4(a.hi.w) - o, b.v[7], s);
    return fma(a.d, s, acc);
}
