// The top-1 of each logits row, one row per workgroup: the largest value that is not NaN, the
// lowest index among equal ones (−0 equals +0), as the host sampler's argmax picks it. Values are
// compared as order-preserving integer keys, so the result does not rest on how a compiler
// treats NaN in float comparisons, and the rule is a total order: the result is the same
// whatever order the candidates are combined in.

struct Params {
    rows: u32,
    width: u32,
    stride: u32,
    x_off: u32,
    out_off: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// Per row: the index (0xffffffff when every value is NaN), then the value's bits.
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
var<workgroup> keys: array<u32, WG>;
var<workgroup> idxs: array<u32, WG>;

// 0 for NaN (below every number's key), else a key whose unsigned order is the values' order.
fn key_of(v: f32) -> u32 {
    var b = bitcast<u32>(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return 0u;
    }
    if ((b & 0x7fffffffu) == 0u) {
        b = 0u;
    }
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

fn value_of(k: u32) -> u32 {
    if ((k & 0x80000000u) != 0u) {
        return k & 0x7fffffffu;
    }
    return ~k;
}

fn better(k: u32, i: u32, bk: u32, bi: u32) -> bool {
    return k > bk || (k == bk && i < bi);
}

@compute @workgroup_size(WG)
fn argmax_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = p.x_off + row * p.stride;
    var bk = 0u;
    var bi = NONE;
    for (var i = lid; i < p.width; i += WG) {
        let k = key_of(x[base + i]);
        // A NaN (key 0) never replaces anything: the first candidate needs a number.
        if (k != 0u && better(k, i, bk, bi)) {
            bk = k;
            bi = i;
        }
    }
    keys[lid] = bk;
    idxs[lid] = bi;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s && better(keys[lid + s], idxs[lid + s], keys[lid], idxs[lid])) {
            keys[lid] = keys[lid + s];
            idxs[lid] = idxs[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let k = keys[0];
        out[p.out_off + 2u * row] = idxs[0];
        out[p.out_off + 2u * row + 1u] = select(0x7fc00000u, value_of(k), k != 0u);
    }
}
