// Q8_0: w holds the 32 signed bytes of each block (2 vec4), the side array its f16 scale.
// A unit is half a block: 16 elements, one vec4 of quants.

struct Unit {
    d: f32,
    q: vec4<u32>,
}

struct XUnit {
    v0: vec4<f32>,
    v1: vec4<f32>,
    v2: vec4<f32>,
    v3: vec4<f32>,
}

fn type_init(lid: u32) {}

fn load_unit(row: u32, u: u32) -> Unit {
    let g = row * p.bpr + (u >> 1u);
    return Unit(half_at(p.aux_off, g), w[g * 2u + (u & 1u)]);
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let c = xb + u * 16u;
    return XUnit(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    var s = dot4(i8x4(a.q.x), b.v0, 0.0);
    s = dot4(i8x4(a.q.y), b.v1, s);
    s = dot4(i8x4(a.q.z), b.v2, s);
    s = dot4(i8x4(a.q.w), b.v3, s);
    return fma(a.d, s, acc);
}
