// Causal softmax attention, first pass: one workgroup per (row, kv head, block of that head's
// query heads, chunk of CHUNK cache positions). For each query it leaves in `part` the chunk's
// largest score m, the sum l of e^(s - m) and the weighted values sum of e^(s - m) v, which the
// second pass (attention_merge.wgsl) folds in chunk order.
//
// Chunks are fixed in absolute positions and every query's arithmetic (the dot products' split
// into 8-value segments summed in segment order, the softmax's lanes, the value sums' position
// splits added in split order) depends only on the head size, so a row's result does not depend
// on the other rows of the dispatch, nor on how many there are. Reductions go through workgroup
// memory; nothing assumes a subgroup size.
//
// Cache layout: see kv.rs (each kv head's positions contiguous; F32, F16 pairs, or Q8_0 codes
// with their scales apart). Element types: 0 f32, 1 f16, 2 q8_0.

struct Params {
    unit0: u32,
    n_units: u32,
    start_pos: u32,
    n_kv: u32,
    group: u32,
    qw: u32,
    head_blocks: u32,
    n_chunks: u32,
    head_dim: u32,
    capacity: u32,
    q_off: u32,
    q_row_stride: u32,
    q_head_stride: u32,
    k_elem: u32,
    v_elem: u32,
    k_scales: u32,
    v_scales: u32,
    scale: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> vc: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>;

const WG: u32 = 256u;
const CHUNK: u32 = 128u;
// Query heads per workgroup at most (the host also keeps qw * head_dim <= 2048).
const QMAX: u32 = 8u;
// Softmax lanes per query.
const LANES: u32 = 32u;
const LOWEST: f32 = -3.4028235e38;

var<workgroup> scores: array<f32, 1024>;   // QMAX * CHUNK
var<workgroup> red: array<f32, 2176>;      // dot partials (8 * 256 + 128), then values
var<workgroup> stat: array<f32, 16>;       // per query: max, then sum

struct Eight {
    a: vec4<f32>,
    b: vec4<f32>,
}

fn signed_bytes(w: u32) -> vec4<f32> {
    return vec4<f32>(f32(bitcast<i32>(w << 24u) >> 24u), f32(bitcast<i32>(w << 16u) >> 24u),
                     f32(bitcast<i32>(w << 8u) >> 24u), f32(bitcast<i32>(w) >> 24u));
}

// The Q8_0 scale of the block holding value d0 of cache row rp (= kv head * capacity + pos).
fn q8_scale(is_v: bool, scales: u32, rp: u32, d0: u32) -> f32 {
    let blk = d0 / 32u;
    let sw = scales + rp * ((p.head_dim + 63u) / 64u) + blk / 2u;
    var w: u32;
    if (is_v) { w = vc[sw / 4u][sw % 4u]; } else { w = kc[sw / 4u][sw % 4u]; }
    return unpack2x16float(w)[blk % 2u];
}

// Keys d0 .. d0 + 7 of cache row rp.
fn load_k8(rp: u32, d0: u32) -> Eight {
    let e = rp * p.head_dim + d0;
    if (p.k_elem == 0u) {
        return Eight(bitcast<vec4<f32>>(kc[e / 4u]), bitcast<vec4<f32>>(kc[e / 4u + 1u]));
    }
    if (p.k_elem == 1u) {
        let w = kc[e / 8u];
        return Eight(vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)),
                     vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w)));
    }
    let word = e / 4u;
    let v = kc[word / 4u];
    let upper = (word & 2u) != 0u;
    let d = q8_scale(false, p.k_scales, rp, d0);
    return Eight(signed_bytes(select(v.x, v.z, upper)) * d, signed_bytes(select(v.y, v.w, upper)) * d);
}

// Values d0 .. d0 + 3 of cache row rp.
fn load_v4(rp: u32, d0: u32) -> vec4<f32> {
    let e = rp * p.head_dim + d0;
    if (p.v_elem == 0u) {
        return bitcast<vec4<f32>>(vc[e / 4u]);
    }
    if (p.v_elem == 1u) {
        let word = e / 2u;
        let v = vc[word / 4u];
        let pair = select(v.xy, v.zw, (word & 2u) != 0u);
        return vec4<f32>(unpack2x16float(pair.x), unpack2x16float(pair.y));
    }
    let word = e / 4u;
    return signed_bytes(vc[word / 4u][word % 4u]) * q8_scale(true, p.v_scales, rp, d0);
}

@compute @workgroup_size(WG)
fn attention_chunk(@builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let idx = wid.x + wid.y * nwg.x;
    let lu = idx % p.n_units;
    let rest = idx / p.n_units;
    let hb = rest % p.head_blocks;
    let c = rest / p.head_blocks;
    if (c >= p.n_chunks) {
        return;
    }
    let unit = p.unit0 + lu;
    let row = unit / p.n_kv;
    let g = unit % p.n_kv;
    let seen = p.start_pos + row + 1u;
    let cs = c * CHUNK;
    if (cs >= seen) {
        return;
    }
    let ce = min(cs + CHUNK, seen);
    let clen = ce - cs;
    let hj0 = hb * p.qw;
    let nq = min(p.qw, p.group - hj0);
    let hd = p.head_dim;
    let row0 = g * p.capacity;

    // Scores: thread (pl, seg) takes 8 values of one position's key against every query.
    let segs = hd / 8u;
    let tile = WG / segs;
    let seg = lid % segs;
    let pl = lid / segs;
    let rs = QMAX * tile + 1u;
    var qa: array<vec4<f32>, QMAX>;
    var qb: array<vec4<f32>, QMAX>;
    for (var j = 0u; j < QMAX; j++) {
        if (j < nq && pl < tile) {
            let b = p.q_off + row * p.q_row_stride + (g * p.group + hj0 + j) * p.q_head_stride
                + seg * 8u;
            qa[j] = vec4<f32>(q[b], q[b + 1u], q[b + 2u], q[b + 3u]);
            qb[j] = vec4<f32>(q[b + 4u], q[b + 5u], q[b + 6u], q[b + 7u]);
        }
    }
    for (var t0 = cs; t0 < ce; t0 += tile) {
        let pos = t0 + pl;
        if (pl < tile && pos < ce) {
            let k = load_k8(row0 + pos, seg * 8u);
            for (var j = 0u; j < QMAX; j++) {
                if (j < nq) {
                    red[seg * rs + j * tile + pl] = dot(qa[j], k.a) + dot(qb[j], k.b);
                }
            }
        }
        workgroupBarrier();
        for (var e = lid; e < nq * tile; e += WG) {
            let j = e / tile;
            let l = e % tile;
            if (t0 + l < ce) {
                var s = 0.0;
                for (var sg = 0u; sg < segs; sg++) {
                    s += red[sg * rs + j * tile + l];
                }
                scores[j * CHUNK + t0 - cs + l] = s * p.scale;
            }
        }
        workgroupBarrier();
    }

    // Softmax within the chunk: LANES lanes per query, each over positions lane, lane + LANES..
    let jq = lid / LANES;
    let lane = lid % LANES;
    var mx = LOWEST;
    if (jq < nq) {
        for (var l = lane; l < clen; l += LANES) {
            mx = max(mx, scores[jq * CHUNK + l]);
        }
    }
    red[lid] = mx;
    workgroupBarrier();
    if (lid < nq) {
        var m = LOWEST;
        for (var k = 0u; k < LANES; k++) {
            m = max(m, red[lid * LANES + k]);
        }
        stat[lid] = m;
    }
    workgroupBarrier();
    for (var e = lid; e < nq * CHUNK; e += WG) {
        if (e % CHUNK < clen) {
            scores[e] = exp(scores[e] - stat[e / CHUNK]);
        }
    }
    workgroupBarrier();
    var sm = 0.0;
    if (jq < nq) {
        for (var l = lane; l < clen; l += LANES) {
            sm += scores[jq * CHUNK + l];
        }
    }
    red[lid] = sm;
    workgroupBarrier();
    if (lid < nq) {
        var t = 0.0;
        for (var k = 0u; k < LANES; k++) {
            t += red[lid * LANES + k];
        }
        stat[QMAX + lid] = t;
    }
    workgroupBarrier();

    // Weighted values: thread (u, split) takes 4 values of every split-th position.
    let units = hd / 4u;
    let splits = WG / units;
    let u = lid % units;
    let split = lid / units;
    var acc: array<vec4<f32>, QMAX>;
    for (var j = 0u; j < QMAX; j++) {
        acc[j] = vec4<f32>(0.0);
    }
    if (split < splits) {
        for (var l = split; l < clen; l += splits) {
            let v = load_v4(row0 + cs + l, u * 4u);
            for (var j = 0u; j < QMAX; j++) {
                if (j < nq) {
                    acc[j] += scores[j * CHUNK + l] * v;
                }
            }
        }
    }
    for (var s = 0u; s < splits; s++) {
        if (split == s) {
            for (var j = 0u; j < QMAX; j++) {
                if (j < nq) {
                    let i = j * hd + u * 4u;
                    if (s == 0u) {
                        red[i] = acc[j].x;
                        red[i + 1u] = acc[j].y;
                        red[i + 2u] = acc[j].z;
                        red[i + 3u] = acc[j].w;
                    } else {
                        red[i] += acc[j].x;
                        red[i + 1u] += acc[j].y;
                        red[i + 2u] += acc[j].z;
                        red[i + 3u] += acc[j].w;
                    }
                }
            }
        }
        workgroupBarrier();
    }

    let slot0 = (lu * p.group + hj0) * p.n_chunks + c;
    for (var e = lid; e < nq * hd; e += WG) {
        let j = e / hd;
        part[(slot0 + j * p.n_chunks) * (hd + 2u) + 2u + e % hd] = red[e];
    }
    if (lid < nq) {
        let r = (slot0 + lid * p.n_chunks) * (hd + 2u);
        part[r] = stat[lid];
        part[r + 1u] = stat[QMAX + lid];
    }
}
