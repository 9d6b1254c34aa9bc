// The conv window after keeping `keep` more raw rows: the last Kc-1 rows of [window, raw rows
// 0..keep], in place. One invocation per channel writes its rows in increasing order; row r
// reads combined row keep+r >= r, which no earlier step of the same invocation has overwritten.

struct Params {
    conv_dim: u32,
    kc: u32,
    keep: u32,
    raw_off: u32,
    raw_stride: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> window: array<f32>;
@group(0) @binding(2) var<storage, read> raw: array<f32>;

const WG: u32 = 64u;

@compute @workgroup_size(WG)
fn delta_net_window_advance(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_index) lid: u32) {
    let ch = (wid.x + wid.y * nwg.x) * WG + lid;
    if (ch >= p.conv_dim) {
        return;
    }
    let kc1 = p.kc - 1u;
    for (var r = 0u; r < kc1; r++) {
        let c = p.keep + r;
        var x: f32;
        if (c < kc1) {
            x = window[c * p.conv_dim + ch];
        } else {
            x = raw[p.raw_off + (c - kc1) * p.raw_stride + ch];
        }
        window[r * p.conv_dim + ch] = x;
    }
}
