// BF16: w holds the rows, each padded with zeros to a multiple of 8 values. A unit is one vec4
// of 8 bfloat16 (the top half of an f32); x past the end of the row reads as zero.

struct Unit {
    q: vec4<u32>,
}

struct XUnit {
    v0: vec4<f32>,
    v1: vec4<f32>,
}

fn type_init(lid: u32) {}

fn x4_masked(xb: u32, c: u32) -> vec4<f32> {
    if (c + 4u <= p.cols) {
        return x4(xb + c);
    }
    var r = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        if (c + i < p.cols) {
            r[i] = xs(xb + c + i);
        }
    }
    return r;
}

fn bf16_pair(v: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xffff0000u));
}

fn load_unit(row: u32, u: u32) -> Unit {
    return Unit(w[row * p.bpr + u]);
}

fn load_x(xb: u32, u: u32) -> XUnit {
    return XUnit(x4_masked(xb, u * 8u), x4_masked(xb, u * 8u + 4u));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    let w0 = vec4<f32>(bf16_pair(a.q.x), bf16_pair(a.q.y));
    let w1 = vec4<f32>(bf16_pair(a.q.z), bf16_pair(a.q.w));
    return dot4(w1, b.v1, dot4(w0, b.v0, acc));
}
