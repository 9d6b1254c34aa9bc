// RMSNorm of every head of every row, in place: one workgroup per (row, head). The sum of
// squares is reduced in a fixed tree over the workgroup, so a head's result depends only on
// its own values.

struct Params {
    n_rows: u32,
    heads: u32,
    head_dim: u32,
    x_off: u32,
    row_stride: u32,
    head_stride: u32,
    w_off: u32,
    eps: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn attention_head_norm(@builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.n_rows * p.heads) {
        return;
    }
    let row = idx / p.heads;
    let head = idx % p.heads;
    let base = p.x_off + row * p.row_stride + head * p.head_stride;
    var s = 0.0;
    for (var i = lid; i < p.head_dim; i += WG) {
        let v = x[base + i];
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
    let scale = 1.0 / sqrt(partial[0] / f32(p.head_dim) + p.eps);
    for (var i = lid; i < p.head_dim; i += WG) {
        x[base + i] = (x[base + i] * scale) * w[p.w_off + i];
    }
}
