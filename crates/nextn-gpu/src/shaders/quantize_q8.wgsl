// Activation rows quantized to int8 as nextn-quant's CPU path does it for the weight type's
// products (ggml's x86 conversions), one block per thread:
// - kind 0, Q8_0 (32 values): d = amax / 127 rounded to f16, q = round_half_even(v * 127 / amax);
// - kind 1, Q8_K (256 values): iscale = -127 / v_max with v_max the first value of largest
//   magnitude, q = min(round_half_even(iscale * v), 127), d = 1 / iscale in f32.
// Row i goes to words [i * q_stride, ...) of q: the packed bytes (cols / 4 words), then from
// word d_off of the row one f32 d per block.

struct Params {
    n: u32,
    cols: u32,
    x_off: u32,
    x_stride: u32,
    q_stride: u32,
    d_off: u32,
    kind: u32,
    // Blocks per row.
    nb: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> q: array<u32>;

fn pack_q(v: vec4<f32>) -> u32 {
    let c = vec4<i32>(clamp(v, vec4<f32>(-128.0), vec4<f32>(127.0)));
    return pack4xI8(c);
}

@compute @workgroup_size(64)
fn quantize_q8(@builtin(global_invocation_id) gid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * 64u;
    if (idx >= p.n * p.nb) {
        return;
    }
    let row = idx / p.nb;
    let b = idx % p.nb;
    let len = select(32u, 256u, p.kind != 0u);
    let src = p.x_off + row * p.x_stride + b * len;
    var amax = 0.0;
    var vmax = 0.0;
    for (var j = 0u; j < len; j++) {
        let v = x[src + j];
        if (abs(v) > amax) {
            amax = abs(v);
            vmax = v;
        }
    }
    let dst = row * p.q_stride + b * (len / 4u);
    var d = 0.0;
    var scale = 0.0;
    if (p.kind == 0u) {
        d = round_f16(div_rn(amax, 127.0));
        scale = select(0.0, div_rn(127.0, amax), amax != 0.0);
    } else if (amax != 0.0) {
        scale = div_rn(-127.0, vmax);
        d = div_rn(1.0, scale);
    }
    for (var j = 0u; j < len; j += 4u) {
        let v = vec4<f32>(x[src + j], x[src + j + 1u], x[src + j + 2u], x[src + j + 3u]);
        var r = round(v * scale);
        if (p.kind != 0u) {
            r = min(r, vec4<f32>(127.0));
        }
        q[dst + j / 4u] = pack_q(r);
    }
    q[row * p.q_stride + p.d_off + b] = bitcast<u32>(d);
}
