// The delta net's gated norm, y_m = RMSNorm(o_m; w) * SiLU(z_m) per v head, with y written as f32
// and quantized for the output projection's int8 product in the same dispatch: one workgroup of
// 256 per row. Two heads at a time, one per half of the workgroup, each with
// delta_net_gated_norm.wgsl's 128-lane tree and products (the same bits); then the row's y is
// read back in chunks of 256 and quantized as quantize_q8.wgsl does.
//
// Quantized outputs by the bits of `flags`: 2, Q8_0 blocks into q0; 4, Q8_K blocks into qk, row
// `q_row0 + t` in the layout of the int8 products.

struct Params {
    n: u32,
    hv: u32,
    dv: u32,
    o_off: u32,
    o_stride: u32,
    z_off: u32,
    z_stride: u32,
    y_off: u32,
    y_stride: u32,
    flags: u32,
    q_row0: u32,
    q0_stride: u32,
    q0_doff: u32,
    qk_stride: u32,
    qk_doff: u32,
    eps: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> o: array<f32>;
@group(0) @binding(2) var<storage, read> z: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> q0: array<u32>;
@group(0) @binding(6) var<storage, read_write> qk: array<u32>;

const WG: u32 = 256u;
const HALF: u32 = 128u;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn delta_net_gated_norm_quant(@builtin(workgroup_id) wid: vec3<u32>,
                              @builtin(num_workgroups) nwg: vec3<u32>,
                              @builtin(local_invocation_index) lid: u32) {
    let t = wid.x + wid.y * nwg.x;
    if (t >= p.n) {
        return;
    }
    let half = lid / HALF;
    let l = lid % HALF;
    let ob = p.o_off + t * p.o_stride;
    let zb = p.z_off + t * p.z_stride;
    let yb = p.y_off + t * p.y_stride;
    for (var m0 = 0u; m0 < p.hv; m0 += 2u) {
        let m = m0 + half;
        let head = m < p.hv;
        var ss = 0.0;
        if (head) {
            for (var j = l; j < p.dv; j += HALF) {
                let v = o[ob + m * p.dv + j];
                ss += v * v;
            }
        }
        partial[lid] = ss;
        workgroupBarrier();
        for (var k = HALF / 2u; k > 0u; k >>= 1u) {
            if (l < k) {
                partial[lid] += partial[lid + k];
            }
            workgroupBarrier();
        }
        let scale = 1.0 / sqrt(partial[half * HALF] / f32(p.dv) + p.eps);
        if (head) {
            for (var j = l; j < p.dv; j += HALF) {
                let zj = z[zb + m * p.dv + j];
                y[yb + m * p.dv + j] =
                    (o[ob + m * p.dv + j] * scale) * w[j] * (zj / (1.0 + exp(-zj)));
            }
        }
        workgroupBarrier();
    }
    if ((p.flags & 6u) == 0u) {
        return;
    }
    // The row's y as every invocation of the workgroup wrote it.
    storageBarrier();
    let width = p.hv * p.dv;
    for (var c0 = 0u; c0 < width; c0 += WG) {
        let i = c0 + lid;
        let live = i < width;
        var v = 0.0;
        if (live) {
            v = y[yb + i];
        }
        if ((p.flags & 2u) != 0u) {
            quantize_chunk(lid, v, live, 0u);
            let base = (p.q_row0 + t) * p.q0_stride;
            if (lid < 64u && c0 + 4u * lid < width) {
                q0[base + c0 / 4u + lid] = q_word(lid);
            }
            if (lid < 8u && c0 + 32u * lid < width) {
                q0[base + p.q0_doff + c0 / 32u + lid] = bitcast<u32>(q_d[lid]);
            }
            workgroupBarrier();
        }
        if ((p.flags & 4u) != 0u) {
            quantize_chunk(lid, v, live, 1u);
            let base = (p.q_row0 + t) * p.qk_stride;
            if (lid < 64u) {
                qk[base + c0 / 4u + lid] = q_word(lid);
            }
            if (lid == 0u) {
                qk[base + p.qk_doff + c0 / 256u] = bitcast<u32>(q_d[0]);
            }
            workgroupBarrier();
        }
    }
}
