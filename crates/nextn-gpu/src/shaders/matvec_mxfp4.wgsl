// MXFP4: w holds each block's 16 bytes of nibbles (one vec4), the side array its E8M0
// exponent byte (four to a word). A unit is one block, nibbles as Q4_0, each an index into
// ggml's kvalues_mxfp4 (doubled e2m1 values, paired with the halved scale).

const KVALUES = array<f32, 16>(0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0,
    0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);

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
    let e = byte_of(word(p.aux_off + (g >> 2u)), g & 3u);
    // ggml_e8m0_to_fp32_half: 2^(e - 128), the two smallest codes as f32 subnormals.
    let d = bitcast<f32>(select((e - 1u) << 23u, 0x00200000u << e, e < 2u));
    return Unit(d, w[g]);
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
