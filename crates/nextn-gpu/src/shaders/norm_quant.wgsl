// RMSNorm of rows, or of parts of rows normed on their own (the NextN head's [embedding |
// hidden] halves), with the results written as f32 and quantized for the int8 products that read
// them, in one dispatch: one workgroup of 256 per (row, part). The norm is rms_norm.wgsl's (the
// same tree, the same products) and the quantization quantize_q8.wgsl's, bit for bit.
//
// Outputs, by the bits of `flags`: 1, every row as f32 into y; 2 and 4, the rows quantized in
// Q8_0 (q0) and Q8_K (qk) blocks in the layout of the int8 products; with 8 the quantized rows
// (and with 16 an f32 copy of the row into yp) go to row pick[row] of their buffers, or nowhere
// when that is 0xffffffff (the LM head's rows among a pass's).

struct Params {
    rows: u32,
    parts: u32,
    width: u32,
    x_off: u32,
    x_stride: u32,
    // Elements from one part of an x row to the next.
    x_part: u32,
    w_off: u32,
    w_stride: u32,
    y_off: u32,
    y_stride: u32,
    flags: u32,
    pick_off: u32,
    q0_stride: u32,
    q0_doff: u32,
    qk_stride: u32,
    qk_doff: u32,
    yp_off: u32,
    yp_stride: u32,
    eps: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> pick: array<u32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> q0: array<u32>;
@group(0) @binding(6) var<storage, read_write> qk: array<u32>;
@group(0) @binding(7) var<storage, read_write> yp: array<f32>;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn norm_quant(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let group = wid.x + wid.y * nwg.x;
    if (group >= p.rows * p.parts) {
        return;
    }
    let row = group / p.parts;
    let part = group % p.parts;
    let xb = p.x_off + row * p.x_stride + part * p.x_part;
    let wb = p.w_off + part * p.w_stride;
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
    var orow = row;
    if ((p.flags & 8u) != 0u) {
        orow = pick[p.pick_off + row];
    }
    let out = orow != NONE;
    let col0 = part * p.width;
    for (var c0 = 0u; c0 < p.width; c0 += WG) {
        let i = c0 + lid;
        let live = i < p.width;
        var v = 0.0;
        if (live) {
            v = x[xb + i] * scale * w[wb + i];
            if ((p.flags & 1u) != 0u) {
                y[p.y_off + row * p.y_stride + col0 + i] = v;
            }
            if ((p.flags & 16u) != 0u && out) {
                yp[p.yp_off + orow * p.yp_stride + col0 + i] = v;
            }
        }
        let col = col0 + c0;
        if ((p.flags & 2u) != 0u) {
            quantize_chunk(lid, v, live, 0u);
            if (out) {
                let base = orow * p.q0_stride;
                if (lid < 64u && c0 + 4u * lid < p.width) {
                    q0[base + col / 4u + lid] = q_word(lid);
                }
                if (lid < 8u && c0 + 32u * lid < p.width) {
                    q0[base + p.q0_doff + col / 32u + lid] = bitcast<u32>(q_d[lid]);
                }
            }
            workgroupBarrier();
        }
        if ((p.flags & 4u) != 0u) {
            quantize_chunk(lid, v, live, 1u);
            if (out) {
                let base = orow * p.qk_stride;
                if (lid < 64u) {
                    qk[base + col / 4u + lid] = q_word(lid);
                }
                if (lid == 0u) {
                    qk[base + p.qk_doff + col / 256u] = bitcast<u32>(q_d[0]);
                }
            }
            workgroupBarrier();
        }
    }
}
