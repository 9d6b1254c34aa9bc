// Causal softmax attention, second pass: fold each query's chunk results (attention_chunk.wgsl)
// in chunk order, normalise, and apply the output gate: out = o / l * sigmoid(gate). A workgroup
// of 256 invocations takes CB blocks of 32 output values of one row (CB = 1, or 8 when the row is
// also quantized for the output projection's int8 product: a chunk of 256 values); for each block
// (kv head g, query head hj of that kv head, values d0..d0+32) they are 32 values x 8 lanes, lane
// k taking the k-th eighth of the row's chunks. How the chunks are shared out depends only on
// the row's own number of chunks, so the result does not depend on the other rows of the
// dispatch, nor on CB.
//
// Quantized outputs by the bits of `flags` (CB = 8): 2, Q8_0 blocks into q0; 4, Q8_K blocks into
// qk, row `q_row0 + row` in the layout of the int8 products; each chunk quantized as
// quantize_q8.wgsl does.

struct Params {
    unit0: u32,
    n_units: u32,
    start_pos: u32,
    n_kv: u32,
    group: u32,
    n_chunks: u32,
    head_dim: u32,
    q_off: u32,
    q_row_stride: u32,
    q_head_stride: u32,
    gate_off: u32,
    out_off: u32,
    out_row_stride: u32,
    cb: u32,
    flags: u32,
    q_row0: u32,
    q0_stride: u32,
    q0_doff: u32,
    qk_stride: u32,
    qk_doff: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> q0: array<u32>;
@group(0) @binding(5) var<storage, read_write> qk: array<u32>;

const WG: u32 = 256u;
const CHUNK: u32 = 128u;
const LANES: u32 = 8u;
const LOWEST: f32 = -3.4028235e38;

var<workgroup> red: array<f32, WG>;
var<workgroup> o_lanes: array<f32, WG>;
var<workgroup> l_lanes: array<f32, LANES>;
var<workgroup> merged: array<f32, WG>;

@compute @workgroup_size(WG)
fn attention_merge(@builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let idx = wid.x + wid.y * nwg.x;
    let hd = p.head_dim;
    // Output values of a row: every query head of every kv head.
    let width = p.n_kv * p.group * hd;
    let per_row = (width + 32u * p.cb - 1u) / (32u * p.cb);
    let rows = p.n_units / p.n_kv;
    let lr = idx / per_row;
    if (lr >= rows) {
        return;
    }
    let c0 = (idx % per_row) * 32u * p.cb;
    let row = p.unit0 / p.n_kv + lr;
    let nc = (p.start_pos + row + CHUNK) / CHUNK;
    let stride = hd + 2u;
    let dl = lid % 32u;
    let lane = lid / 32u;
    for (var b = 0u; b < p.cb; b++) {
        let col = c0 + b * 32u;
        if (col >= width) {
            break;
        }
        let h = col / hd;
        let g = h / p.group;
        let hj = h % p.group;
        let lu = lr * p.n_kv + g;
        let slot0 = (lu * p.group + hj) * p.n_chunks;

        // The largest chunk maximum (a maximum: any order gives the same value).
        var mx = LOWEST;
        for (var c = lid; c < nc; c += WG) {
            mx = max(mx, part[(slot0 + c) * stride]);
        }
        red[lid] = mx;
        workgroupBarrier();
        for (var k = WG / 2u; k > 0u; k >>= 1u) {
            if (lid < k) {
                red[lid] = max(red[lid], red[lid + k]);
            }
            workgroupBarrier();
        }
        let m = red[0];

        let d = col % hd + dl;
        let per = (nc + LANES - 1u) / LANES;
        let ca = lane * per;
        let cz = min(ca + per, nc);
        var o = 0.0;
        var l = 0.0;
        for (var c = ca; c < cz; c++) {
            let r = (slot0 + c) * stride;
            let w = exp(part[r] - m);
            l += part[r + 1u] * w;
            o += part[r + 2u + d] * w;
        }
        o_lanes[lid] = o;
        if (dl == 0u) {
            l_lanes[lane] = l;
        }
        workgroupBarrier();
        if (lane == 0u) {
            var os = 0.0;
            var ls = 0.0;
            for (var k = 0u; k < LANES; k++) {
                os += o_lanes[k * 32u + dl];
                ls += l_lanes[k];
            }
            let gate = q[p.q_off + row * p.q_row_stride + h * p.q_head_stride + p.gate_off + d];
            let v = os / ls * (1.0 / (1.0 + exp(-gate)));
            out[p.out_off + row * p.out_row_stride + h * hd + d] = v;
            merged[b * 32u + dl] = v;
        }
        // The lanes' sums are read; the next block may overwrite them.
        workgroupBarrier();
    }
    if ((p.flags & 6u) == 0u) {
        return;
    }
    let i = c0 + lid;
    let live = i < width;
    var v = 0.0;
    if (live) {
        v = merged[lid];
    }
    let qrow = p.q_row0 + row;
    if ((p.flags & 2u) != 0u) {
        quantize_chunk(lid, v, live, 0u);
        let base = qrow * p.q0_stride;
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
        let base = qrow * p.qk_stride;
        if (lid < 64u) {
            qk[base + c0 / 4u + lid] = q_word(lid);
        }
        if (lid == 0u) {
            qk[base + p.qk_doff + c0 / 256u] = bitcast<u32>(q_d[0]);
        }
    }
}
