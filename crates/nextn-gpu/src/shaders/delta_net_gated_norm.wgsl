// y_m = RMSNorm(o_m; w) * SiLU(z_m) per row and v head (dv values, w shared by the heads). One
// workgroup per (row, head); the sum of squares is reduced in a fixed tree.

struct Params {
    n: u32,
    hv: u32,
    dv: u32,
    z_off: u32,
    z_stride: u32,
    eps: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> o: array<f32>;
@group(0) @binding(2) var<storage, read> z: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const WG: u32 = 128u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn delta_net_gated_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let group = wid.x + wid.y * nwg.x;
    if (group >= p.n * p.hv) {
        return;
    }
    let t = group / p.hv;
    let m = group % p.hv;
    let ob = group * p.dv;
    let zb = p.z_off + t * p.z_stride + m * p.dv;
    var ss = 0.0;
    for (var j = lid; j < p.dv; j += WG) {
        let v = o[ob + j];
        ss += v * v;
    }
    partial[lid] = ss;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            partial[lid] += partial[lid + k];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / sqrt(partial[0] / f32(p.dv) + p.eps);
    for (var j = lid; j < p.dv; j += WG) {
        let zj = z[zb + j];
        y[ob + j] = (o[ob + j] * scale) * w[j] * (zj / (1.0 + exp(-zj)));
    }
}
