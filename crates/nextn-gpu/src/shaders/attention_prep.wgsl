// An attention layer's rows between their projections and attention, in place, in one
// dispatch: the RMSNorm of every q and k head, the partial NEOX rotary embedding of both (at the
// rows' text or image positions, multi-section as the CPU's RopeTable::new_3d), and the
// keys and values into the KV cache (converted to its element types). One workgroup of 64 per
// (row, head): the query heads, then the kv heads, each of which also stores its keys and
// values. What runs is `flags`: 1 the norms, 2 the rotation, 4 the store.
//
// Every value has the bits of the separate kernels' arithmetic: the norm of
// attention_head_norm.wgsl (the same 64-lane tree and products), the angles and rotation of
// rope_neox.wgsl (ggml's angle bits, the exact reduction of rope_sincos.wgsl), the conversions
// of kv_convert.wgsl. Layout of a row (from x_off, x_stride apart): query head h at
// h * q_head_stride (its gate follows it, untouched), key head g at k_col + g * head_dim, value
// head g at v_col + g * head_dim; the cache as kv.rs lays it out.

struct Params {
    n: u32,
    n_head: u32,
    n_kv: u32,
    head_dim: u32,
    x_off: u32,
    x_stride: u32,
    q_head_stride: u32,
    k_col: u32,
    v_col: u32,
    qn_off: u32,
    kn_off: u32,
    half_rot: u32,
    start_pos: u32,
    theta_scale: f32,
    freq_scale: f32,
    capacity: u32,
    k_elem: u32,
    v_elem: u32,
    k_scales: u32,
    v_scales: u32,
    flags: u32,
    eps: f32,
    // Rotary position of cache row c: c - shift for text; an image (image_nx > 0) row i at
    // (p0, p0 + i / image_nx, p0 + i % image_nx), p0 = start_pos - shift.
    shift: u32,
    image_nx: u32,
    // Pair j turns by the t, h or w position when j % 3 is 0, 1 or 2 and j / 3 is under that
    // section's size, otherwise not at all (IMROPE).
    sect_t: u32,
    sect_h: u32,
    sect_w: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> norms: array<f32>;
@group(0) @binding(3) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(4) var<storage, read_write> v_cache: array<u32>;

const WG: u32 = 64u;
var<workgroup> partial: array<f32, WG>;

fn put(is_v: bool, word: u32, value: u32) {
    if (is_v) {
        v_cache[word] = value;
    } else {
        k_cache[word] = value;
    }
}

// Values d0 .. d0 + len of one head (from x at src) into the cache row row_pos (kv head *
// capacity + position), as kv_store.wgsl stores them.
fn store_unit(is_v: bool, elem: u32, src: u32, row_pos: u32, d0: u32, len: u32, scales: u32) {
    let hd = p.head_dim;
    let dst = row_pos * hd + d0;
    if (elem == 0u) {
        for (var k = 0u; k < len; k++) {
            put(is_v, dst + k, bitcast<u32>(x[src + k]));
        }
    } else if (elem == 1u) {
        for (var k = 0u; k < len; k += 2u) {
            put(is_v, (dst + k) / 2u, f16_bits(x[src + k]) | (f16_bits(x[src + k + 1u]) << 16u));
        }
    } else {
        var halves = array<u32, 2>(0u, 0u);
        for (var h = 0u; h < 2u; h++) {
            if (h * 32u < len) {
                var v: array<f32, 32>;
                for (var k = 0u; k < 32u; k++) {
                    v[k] = x[src + h * 32u + k];
                }
                let blk = q8_block(v);
                for (var w = 0u; w < 8u; w++) {
                    put(is_v, dst / 4u + h * 8u + w, blk.words[w]);
                }
                halves[h] = blk.d;
            }
        }
        let word = scales + row_pos * ((hd + 63u) / 64u) + d0 / 64u;
        put(is_v, word, halves[0] | (halves[1] << 16u));
    }
}

@compute @workgroup_size(WG)
fn attention_prep(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let heads = p.n_head + p.n_kv;
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.n * heads) {
        return;
    }
    let row = idx / heads;
    let h = idx % heads;
    let is_q = h < p.n_head;
    let g = h - select(p.n_head, 0u, is_q);
    let rb = p.x_off + row * p.x_stride;
    var base = rb + p.k_col + g * p.head_dim;
    var w_off = p.kn_off;
    if (is_q) {
        base = rb + h * p.q_head_stride;
        w_off = p.qn_off;
    }
    if ((p.flags & 1u) != 0u) {
        var s = 0.0;
        for (var i = lid; i < p.head_dim; i += WG) {
            let v = x[base + i];
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
        let scale = 1.0 / sqrt(partial[0] / f32(p.head_dim) + p.eps);
        for (var i = lid; i < p.head_dim; i += WG) {
            x[base + i] = (x[base + i] * scale) * norms[w_off + i];
        }
        storageBarrier();
    }
    if ((p.flags & 2u) != 0u) {
        let p0 = p.start_pos - p.shift;
        var pos = vec3<u32>(p0 + row, p0 + row, p0 + row);
        if (p.image_nx != 0u) {
            pos = vec3<u32>(p0, p0 + row / p.image_nx, p0 + row % p.image_nx);
        }
        for (var i = lid; i < p.half_rot; i += WG) {
            let q = i / 3u;
            let r = i % 3u;
            var theta = 0.0;
            if (r == 1u && q < p.sect_h) {
                theta = f32(pos.y);
            } else if (r == 2u && q < p.sect_w) {
                theta = f32(pos.z);
            } else if (r == 0u && q < p.sect_t) {
                theta = f32(pos.x);
            }
            for (var k = 0u; k < i; k++) {
                theta = theta * p.theta_scale;
            }
            let sc = sincos(theta * p.freq_scale);
            let x0 = x[base + i];
            let x1 = x[base + i + p.half_rot];
            x[base + i] = x0 * sc.y - x1 * sc.x;
            x[base + i + p.half_rot] = x0 * sc.x + x1 * sc.y;
        }
        storageBarrier();
    }
    if ((p.flags & 4u) == 0u || is_q) {
        return;
    }
    let units = (p.head_dim + 63u) / 64u;
    let row_pos = g * p.capacity + p.start_pos + row;
    for (var u = lid; u < units; u += WG) {
        let d0 = u * 64u;
        let len = min(64u, p.head_dim - d0);
        store_unit(false, p.k_elem, base + d0, row_pos, d0, len, p.k_scales);
        store_unit(true, p.v_elem, rb + p.v_col + g * p.head_dim + d0, row_pos, d0, len,
                   p.v_scales);
    }
}
