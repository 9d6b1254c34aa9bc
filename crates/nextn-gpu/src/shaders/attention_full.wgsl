// Full (non-causal) softmax attention of fused qkv rows, every query over every key of its head
// (the vision tower's): out = softmax(scale · K q) V per head, computed flash-style. One
// workgroup takes QB queries of one head and walks the keys in chunks of KB: scores, the chunk's
// running maximum and sum (online softmax), then the weighted values. Every query's result is
// the same sequence of operations whatever the other queries of its workgroup are: a row's bits
// depend only on its own row and the keys.

struct Params {
    n: u32,
    n_head: u32,
    d: u32,
    off: u32,
    stride: u32,
    // Elements from a row's q part to its k part, and to its v part.
    k_off: u32,
    v_off: u32,
    out_off: u32,
    out_stride: u32,
    scale: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

const WG: u32 = 128u;
const QB: u32 = 8u;
const KB: u32 = 16u;
const D_MAX: u32 = 128u;
// Outputs (query, channel) a thread keeps.
const OUT_PER: u32 = QB * D_MAX / WG;
// A score no key has: its exponential underflows to zero against any real score.
const NONE: f32 = -1e30;

var<workgroup> qs: array<f32, QB * D_MAX>;
var<workgroup> kv: array<f32, KB * D_MAX>;
var<workgroup> ps: array<f32, QB * KB>;
var<workgroup> factor: array<f32, QB>;

// Rows k0..k0+KB (zeros past the last) of the part starting `at` elements into a row, into kv.
fn load_chunk(k0: u32, at: u32, lid: u32) {
    for (var i = lid; i < KB * p.d; i += WG) {
        let row = k0 + i / p.d;
        var v = 0.0;
        if (row < p.n) {
            v = qkv[p.off + row * p.stride + at + i % p.d];
        }
        kv[(i / p.d) * D_MAX + i % p.d] = v;
    }
}

@compute @workgroup_size(WG)
fn attention_full(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let blocks = (p.n + QB - 1u) / QB;
    let g = wid.x + wid.y * nwg.x;
    if (g >= blocks * p.n_head) {
        return;
    }
    let head = g / blocks;
    let q0 = (g % blocks) * QB;
    let d = p.d;
    let col = head * d;
    for (var i = lid; i < QB * d; i += WG) {
        let row = q0 + i / d;
        var v = 0.0;
        if (row < p.n) {
            v = qkv[p.off + row * p.stride + col + i % d];
        }
        qs[(i / d) * D_MAX + i % d] = v;
    }
    var m = NONE;
    var l = 0.0;
    var acc: array<f32, OUT_PER>;
    for (var r = 0u; r < OUT_PER; r++) {
        acc[r] = 0.0;
    }
    for (var k0 = 0u; k0 < p.n; k0 += KB) {
        workgroupBarrier();
        load_chunk(k0, p.k_off + col, lid);
        workgroupBarrier();
        // QB * KB == WG: one score a thread.
        let qi = lid / KB;
        let kj = lid % KB;
        var s = 0.0;
        for (var c = 0u; c < d; c++) {
            s += qs[qi * D_MAX + c] * kv[kj * D_MAX + c];
        }
        s = s * p.scale;
        if (k0 + kj >= p.n) {
            s = NONE;
        }
        ps[lid] = s;
        workgroupBarrier();
        if (lid < QB) {
            var top = NONE;
            for (var j = 0u; j < KB; j++) {
                top = max(top, ps[lid * KB + j]);
            }
            let m_new = max(m, top);
            let a = exp(m - m_new);
            var sum = 0.0;
            for (var j = 0u; j < KB; j++) {
                let e = exp(ps[lid * KB + j] - m_new);
                ps[lid * KB + j] = e;
                sum += e;
            }
            l = l * a + sum;
            m = m_new;
            factor[lid] = a;
        }
        // After the scores' barrier: every thread is done with the keys.
        load_chunk(k0, p.v_off + col, lid);
        workgroupBarrier();
        for (var r = 0u; r < OUT_PER; r++) {
            let o = lid + r * WG;
            if (o < QB * d) {
                let q = o / d;
                let c = o % d;
                var sv = 0.0;
                for (var j = 0u; j < KB; j++) {
                    sv += ps[q * KB + j] * kv[j * D_MAX + c];
                }
                acc[r] = acc[r] * factor[q] + sv;
            }
        }
    }
    workgroupBarrier();
    if (lid < QB) {
        factor[lid] = l;
    }
    workgroupBarrier();
    for (var r = 0u; r < OUT_PER; r++) {
        let o = lid + r * WG;
        let q = o / d;
        if (o < QB * d && q0 + q < p.n) {
            out[p.out_off + (q0 + q) * p.out_stride + col + o % d] = acc[r] / factor[q];
        }
    }
}
