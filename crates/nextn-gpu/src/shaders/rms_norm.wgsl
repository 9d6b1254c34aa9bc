// RMSNorm of one row per workgroup. The sum of squares is reduced in a fixed tree over the
// workgroup, so a row's result depends only on the row.

struct Params {
    rows: u32,
    width: u32,
    stride: u32,
    x_off: u32,
    y_off: u32,
    w_off: u32,
    eps: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const WG: u32 = 256u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let xb = p.x_off + row * p.stride;
    let yb = p.y_off + row * p.stride;
    var s = 0.0;
    for (var i = lid; i < p.width; i += WG) {
        let v = x[xb + i];
        s += v * v;
    }
    partial[lid] = s;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            partial[lid] += partial[lid + k];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / sqrt(partial[0] / f32(p.width) + p.eps);
    for (var i = lid; i < p.width; i += WG) {
        y[yb + i] = x[xb + i] * scale * w[p.w_off + i];
    }
}
