// Per row and v head: beta = sigmoid(b), decay = exp(softplus(alpha + dt_bias) * a).

struct Params {
    n: u32,
    hv: u32,
    b_off: u32,
    b_stride: u32,
    alpha_off: u32,
    alpha_stride: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read> alpha: array<f32>;
@group(0) @binding(3) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(4) var<storage, read> a: array<f32>;
@group(0) @binding(5) var<storage, read_write> beta_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> decay_out: array<f32>;

const WG: u32 = 64u;

// log(1 + e^x) for x <= 20, e^x > 20 otherwise. log1p through log(u) * e / (u - 1), which keeps the
// relative accuracy of e where 1 + e rounds (WGSL has no log1p).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    let e = exp(x);
    let u = 1.0 + e;
    if (u == 1.0) {
        return e;
    }
    return log(u) * (e / (u - 1.0));
}

@compute @workgroup_size(WG)
fn delta_net_gates(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let idx = (wid.x + wid.y * nwg.x) * WG + lid;
    if (idx >= p.n * p.hv) {
        return;
    }
    let t = idx / p.hv;
    let m = idx % p.hv;
    let bv = b[p.b_off + t * p.b_stride + m];
    beta_out[idx] = 1.0 / (1.0 + exp(-bv));
    let av = alpha[p.alpha_off + t * p.alpha_stride + m];
    decay_out[idx] = exp(softplus(av + dt_bias[m]) * a[m]);
}
