// F32: w holds the rows, each padded with zeros to a multiple of 4 values. A unit is one vec4;
// x past the end of the row reads as zero.

struct Unit {
    v: vec4<f32>,
}

struct XUnit {
    v: vec4<f32>,
}

fn type_init(lid: u32) {}

// x[xb + c ..][..4] with the values at or past `cols` zeroed.
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

fn load_unit(row: u32, u: u32) -> Unit {
    return Unit(bitcast<vec4<f32>>(w[row * p.bpr + u]));
}

fn load_x(xb: u32, u: u32) -> XUnit {
    return XUnit(x4_masked(xb, u * 4u));
}

fn dot_unit(a: Unit, b: XUnit, acc: f32) -> f32 {
    return dot4(a.v, b.v, acc);
}
