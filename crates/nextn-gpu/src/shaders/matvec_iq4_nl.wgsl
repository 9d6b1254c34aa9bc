// IQ4_NL: w holds each block's 16 bytes of nibbles (one vec4), the side array its f16 scale.
// A unit is one block, nibbles as Q4_0, each an index into ggml's kvalues_iq4nl, read from
// workgroup memory.

const KVALUES = array<f32, 16>(-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
    1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);

var<workgroup> lut: array<f32, 16>;

struct Unit {
    d: f32,
    q: vec4<u32>,
}

struct XUnit {
    v: array<vec4<f32>, 8>,
}

fn type_init(lid: u32) {
    if (lid < 16u) {
        lut[lid] = KVALUES[lid];
    }
    workgroupBarrier();
}

// The values of the low nibbles of the four bytes of v.
fn lut4(v: u32) -> vec4<f32> {
    return vec4<f32>(lut[v & 15u], lut[(v >> 8u) & 15u], lut[(v >> 16u) & 15u], lut[(v >> 24u) & 15u]);
}

fn load_unit(row: u32, u: u32) -> Unit {
    let g = row * p.bpr + u;
    return Unit(half_at(p.aux_off, g), w[g]);
}

fn load_x(xb: u32, u: u32) -> XUnit {
    let c = xb + u * 32u;
    return XUnit(array<vec4<f32>, 8>(x4(c), x4(c + 4u), x4(c + 8u), x4(c + 12u),
        x4(c + 16u), x4(c + 20u), x4(c + 24u), x4(c + 28u)));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    var s = dot4(lut4(a.q.x), b.v[0], 0.0);
    s = dot4(lut4(a.q.y), b.v[1], s);
    s = dot4(lut4(a.q.z), b.v[2], s);
    s = dot4(lut4(a.q.w), b.v[3], s);
    s = dot4(lut4(a.q.x >> 4u), b.v[4], s);
    s = dot4(lut4(a.q.y >> 4u), b.v[5], s);
    s = dot4(lut4(a.q.z >> 4u), b.v[6], s);
    s = dot4(lut4(a.q.w >> 4u), b.v[7], s);
    return fma(a.d, s, acc);
}
