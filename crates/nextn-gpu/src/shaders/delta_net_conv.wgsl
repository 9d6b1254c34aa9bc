// Causal depthwise conv + SiLU of one sequence's rows, then the L2 norm of every q and k head.
// One workgroup per (row, head) where the heads are the Hk q heads, the Hk k heads and the Hv v
// heads in channel order; a head's sum of squares is reduced in a fixed tree, so a row's result
// depends only on the row, the window and the raw rows before it.
//
// Row t reads the combined sequence [window (Kc-1 rows, oldest first), raw rows 0..n] at rows
// t..t+Kc-1 and weighs them with taps 0..Kc-1 of its channel, oldest first, summed in that order.

struct Params {
    n: u32,
    conv_dim: u32,
    kc: u32,
    raw_off: u32,
    raw_stride: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    eps: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> raw: array<f32>;
@group(0) @binding(2) var<storage, read> window: array<f32>;
@group(0) @binding(3) var<storage, read> conv_w: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const WG: u32 = 128u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn delta_net_conv_silu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    let heads = 2u * p.hk + p.hv;
    let group = wid.x + wid.y * nwg.x;
    if (group >= p.n * heads) {
        return;
    }
    let t = group / heads;
    let h = group % heads;
    let is_qk = h < 2u * p.hk;
    var base: u32;
    var width: u32;
    if (is_qk) {
        base = h * p.dk;
        width = p.dk;
    } else {
        base = 2u * p.hk * p.dk + (h - 2u * p.hk) * p.dv;
        width = p.dv;
    }
    let kc1 = p.kc - 1u;
    let ob = t * p.conv_dim;
    var ss = 0.0;
    for (var c = lid; c < width; c += WG) {
        let ch = base + c;
        var sum = 0.0;
        for (var j = 0u; j < p.kc; j++) {
            let r = t + j;
            var x: f32;
            if (r < kc1) {
                x = window[r * p.conv_dim + ch];
            } else {
                x = raw[p.raw_off + (r - kc1) * p.raw_stride + ch];
            }
            sum += x * conv_w[ch * p.kc + j];
        }
        let y = sum / (1.0 + exp(-sum));
        out[ob + ch] = y;
        ss += y * y;
    }
    if (!is_qk) {
        return;
    }
    partial[lid] = ss;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            partial[lid] += partial[lid + k];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / max(sqrt(partial[0]), p.eps);
    // Each invocation rescales only the values it wrote itself.
    for (var c = lid; c < width; c += WG) {
        out[ob + base + c] *= scale;
    }
}
