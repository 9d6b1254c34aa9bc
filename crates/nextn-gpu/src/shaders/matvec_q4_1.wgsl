// Q4_1: w holds each block's 16 bytes of nibbles (one vec4), the side array its f16 scale and
// f16 minimum in one word. A unit is one block, nibbles as Q4_0.

struct Unit {
    d: f32,
    m: f32,
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
    let dm = unpack2x16float(word(p.aux_off + g));
    return Unit(dm.x, dm.y, q & vec4<u32>(0x0f0f0f0fu), (q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu));
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let c = xb + u * 32u;
    return XUnit(array<vec4<f32>, 8>(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u),
        x4(c + 16u), x4(c + 20u), x4(c + 24u), x4(c + 28u)));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    var s = dot4(u8x4(a.lo.x), b.v[0], 0.0);
    s = dot4(u8x4(a.lo.y), b.v[1], s);
    s = dot4(u8x4(a.lo.z), b.v[2], s);
    s = dot4(u8x4(a.lo.w), b.v[3], s);
    s = dot4(u8x4(a.hi.x), b.v[4], s);
    s = dot4(u8x4(a.hi.y), b.v[5], s);
    s = dot4(u8x4(a.hi.z), b.v[6], s);
    s = dot4(u8x4(a.hi.w), b.v[7], s);
    var sx = sum4(b.v[0], 0.0);
    for (var k = 1u; k < 8u; k++) {
        sx = sum4(b.v[k], sx);
    }
    // Scale term first: with a single non-zero x this is exactly ggml's d * q + m.
    return fma(a.m, sx, fma(a.d, s, acc));
}
