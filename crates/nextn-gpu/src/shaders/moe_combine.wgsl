// out[r][c] (+)= sum_s w[r*k+s] * y[(r*k+s)][c]  (+ sigmoid(gate[r]) * shared[r][c]), the sum added
// to what out holds when `add` is set (the layer's residual).
struct Params {
    n: u32,
    k: u32,
    width: u32,
    has_shared: u32,
    gate_off: u32,
    gate_stride: u32,
    add: u32,
}
@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> shared_out: array<f32>;
@group(0) @binding(4) var<storage, read> shared_gate: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn moe_combine(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n * p.width) {
        return;
    }
    let r = i / p.width;
    let c = i % p.width;
    var acc = 0.0;
    for (var s = 0u; s < p.k; s++) {
        acc += w[r * p.k + s] * y[(r * p.k + s) * p.width + c];
    }
    if (p.has_shared != 0u) {
        let g = 1.0 / (1.0 + exp(-shared_gate[p.gate_off + r * p.gate_stride]));
        acc += g * shared_out[i];
    }
    if (p.add != 0u) {
        out[i] = out[i] + acc;
    } else {
        out[i] = acc;
    }
}
