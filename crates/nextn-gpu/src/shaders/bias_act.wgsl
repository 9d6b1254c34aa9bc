// A bias added to rows in place, then optionally other rows added (the position embeddings after
// the patch embedding) and GELU (the tower's MLPs):
// y[r][c] = act((y[r][c] + b[c]) + extra[r][c]).
// GELU is ggml's on the CPU: the tanh form of the input rounded to f16, itself rounded to f16,
// identity from 10 up and zero from -10 down.

struct Params {
    rows: u32,
    width: u32,
    y_off: u32,
    y_stride: u32,
    // Bit 0: GELU; bit 1: add the extra rows.
    flags: u32,
    e_off: u32,
    e_stride: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> extra: array<f32>;

fn to_f16(v: f32) -> f32 {
    return unpack2x16float(pack2x16float(vec2<f32>(v, 0.0))).x;
}

fn gelu(v: f32) -> f32 {
    if (v <= -10.0) {
        return 0.0;
    }
    if (v >= 10.0) {
        return v;
    }
    let x = to_f16(v);
    // 0.5 x (1 + tanh t) written as x / (1 + e^(-2t)): the same value without the cancellation
    // of 1 + tanh t near -1, where the tail's tiny results would lose every digit. 2t is clamped
    // where e^(-2t) is still finite and the result already rounds to zero (or x) in f16.
    let t = 0.7978846 * x * (1.0 + 0.044715 * x * x);
    return to_f16(x / (1.0 + exp(clamp(-2.0 * t, -80.0, 80.0))));
}

@compute @workgroup_size(256)
fn bias_act(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.rows * p.width) {
        return;
    }
    let r = i / p.width;
    let c = i % p.width;
    let at = p.y_off + r * p.y_stride + c;
    var v = y[at] + b[c];
    if ((p.flags & 2u) != 0u) {
        v = v + extra[p.e_off + r * p.e_stride + c];
    }
    if ((p.flags & 1u) != 0u) {
        v = gelu(v);
    }
    y[at] = v;
}
