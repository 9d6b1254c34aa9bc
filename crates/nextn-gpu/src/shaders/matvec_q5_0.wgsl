// Q5_0: w holds each block's 16 bytes of low nibbles (one vec4); the side arrays hold its 32
// fifth bits (one word) and its f16 scale. A unit is one block: element j < 16 in the low
// nibble of byte j, element j + 16 in its high nibble, bit 4 of element j is bit j of qh.

struct Unit {
    d: f32,
    lo: vec4<u32>,
    hi: vec4<u32>,
}

struct XUnit {
    v: array<vec4<f32>, 8>,
}

fn type_init(lid: u32) {}

// The four bytes of word k of the nibbles, each with its fifth bit at bit 4.
fn q5_codes(q: vec4<u32>, qh: u32) -> vec4<u32> {
    return (q & vec4<u32>(0x0f0f0f0fu)) | (vec4<u32>(spread4(qh & 15u), spread4((qh >> 4u) & 15u),
        spread4((qh >> 8u) & 15u), spread4((qh >> 12u) & 15u)) << vec4<u32>(4u));
}

fn load_unit(row: u32, u: u32) -> Unit {
    let g = row * p.bpr + u;
    let q = w[g];
    let qh = word(p.aux_off + g);
    return Unit(half_at(p.aux2_off, g), q5_codes(q, qh), q5_codes(q >> vec4<u32>(4u), qh >> 16u));
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let c = xb + u * 32u;
    return XUnit(array<vec4<f32>, 8>(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u),
        x4(c + 16u), x4(c + 20u), x4(c + 24u), x4(c + 28u)));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    let o = vec4<f32>(16.0);
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
