// Layer norm of rows with a weight and a bias (the vision tower's norms):
// y = (x - mean) / sqrt(var + eps) * w + b, one workgroup of 256 per row. The mean and the
// variance are f32 trees over the workgroup in a fixed order: a row's bits depend only on the row.

struct Params {
    rows: u32,
    width: u32,
    x_off: u32,
    x_stride: u32,
    y_off: u32,
    y_stride: u32,
    eps: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const WG: u32 = 256u;
var<workgroup> partial: array<f32, WG>;

fn tree(lid: u32) -> f32 {
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            partial[lid] += partial[lid + k];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(WG)
fn layer_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let xb = p.x_off + row * p.x_stride;
    var s = 0.0;
    for (var i = lid; i < p.width; i += WG) {
        s += x[xb + i];
    }
    partial[lid] = s;
    let mean = tree(lid) / f32(p.width);
    var v = 0.0;
    for (var i = lid; i < p.width; i += WG) {
        let d = x[xb + i] - mean;
        v += d * d;
    }
    partial[lid] = v;
    let scale = 1.0 / sqrt(tree(lid) / f32(p.width) + p.eps);
    let yb = p.y_off + row * p.y_stride;
    for (var i = lid; i < p.width; i += WG) {
        y[yb + i] = ((x[xb + i] - mean) * scale) * w[i] + b[i];
    }
}
