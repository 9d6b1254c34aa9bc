// Causal softmax attention, second pass: fold each query's chunk results (attention_chunk.wgsl)
// in chunk order, normalise, and apply the output gate: out = o / l * sigmoid(gate).
// One workgroup per (row, kv head, query head of that kv head, 32 output values); its 256
// invocations are 32 values x 8 lanes, lane k taking the k-th eighth of the row's chunks.
// How the chunks are shared out depends only on the row's own number of chunks, so the
// result does not depend on the other rows of the dispatch.

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
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const WG: u32 = 256u;
const CHUNK: u32 = 128u;
const LANES: u32 = 8u;
const LOWEST: f32 = -3.4028235e38;

var<workgroup> red: array<f32, WG>;
var<workgroup> o_lanes: array<f32, WG>;
var<workgroup> l_lanes: array<f32, LANES>;

@compute @workgroup_size(WG)
fn attention_merge(@builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let idx = wid.x + wid.y * nwg.x;
    let hd = p.head_dim;
    let blocks = hd / 32u;
    let db = idx % blocks;
    let rest = idx / blocks;
    let hj = rest % p.group;
    let lu = rest / p.group;
    if (lu >= p.n_units) {
        return;
    }
    let unit = p.unit0 + lu;
    let row = unit / p.n_kv;
    let g = unit % p.n_kv;
    let nc = (p.start_pos + row + CHUNK) / CHUNK;
    let slot0 = (lu * p.group + hj) * p.n_chunks;
    let stride = hd + 2u;

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

    let dl = lid % 32u;
    let lane = lid / 32u;
    let d = db * 32u + dl;
    let per = (nc + LANES - 1u) / LANES;
    let c0 = lane * per;
    let c1 = min(c0 + per, nc);
    var o = 0.0;
    var l = 0.0;
    for (var c = c0; c < c1; c++) {
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
        let h = g * p.group + hj;
        let gate = q[p.q_off + row * p.q_row_stride + h * p.q_head_stride + p.gate_off + d];
        out[p.out_off + row * p.out_row_stride + h * hd + d] = os / ls * (1.0 / (1.0 + exp(-gate)));
    }
}
