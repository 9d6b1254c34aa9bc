// Weight matrix times activation rows quantized to int8 (quantize_q8.wgsl), with packed 4 x 8-bit
// integer dot products. The host prepends `const N` (activation rows per workgroup), `const R`
// (weight rows per thread) and `const RED` (outputs reduced per round through workgroup memory)
// and appends reduce_slot.wgsl and the type's part: `SUBS`, `HAS_MIN`, `Head`, `Sub`, `load_head`,
// `load_sub`, `sub_dot`, `block_term`.
//
// The work is cut as in matvec.wgsl, with a unit being a part of a weight block (32 or 256
// values, the activations' block): the block's SUBS 32-value sub-blocks shared by 2^split_log2
// threads, so that a narrow row (a few 256-value blocks) still spreads over a subgroup's worth of
// threads and a matrix over many workgroups. A slot of 2^tpr_log2 threads owns R weight rows;
// thread t takes units t, t + tpr, ... of the row, consecutive threads reading consecutive bytes
// of a block. Within a unit the products are exact integer sums over its sub-blocks (times the
// sub-block scales), as nextn-quant's CPU kernels form them, then one f32 term with the block's
// scales; the slot adds its partials in a fixed tree. tpr and the split depend only on the
// matrix shape, and each (weight row, activation row) pair is computed by the same sequence of
// operations whatever N, R, RED or the row's place: a row's result does not depend on the batch
// it is part of.

struct Params {
    rows: u32,
    // Blocks per weight row.
    blocks: u32,
    tpr_log2: u32,
    aux_off: u32,
    aux2_off: u32,
    // Words per quantized activation row, and where its f32 scales start within it.
    q_stride: u32,
    d_off: u32,
    y_off: u32,
    y_stride: u32,
    y_row0: u32,
    batch0: u32,
    n_used: u32,
    ids_off: u32,
    e_base: u32,
    e_count: u32,
    x_per_slot: u32,
    pair0: u32,
    // Bit 0: add the results to y (a residual) instead of storing them. Bit 1 is set with
    // P = 2 (SwiGLU of a gate|up pair).
    mode: u32,
    // The tensor's scale, multiplied into every result (1 when it has none: exact).
    scale: f32,
    // With P = 2: the rows of one matrix of the pair (the up rows follow the gate rows).
    half_rows: u32,
    // log2 of the threads that share a weight block (a divisor of SUBS).
    split_log2: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const WG: u32 = 128u;
var<workgroup> partial: array<f32, WG * RED * P>;

fn word(i: u32) -> u32 {
    return w[i >> 2u][i & 3u];
}

fn xword(i: u32) -> u32 {
    return xq[i >> 2u][i & 3u];
}

fn half_at(base: u32, i: u32) -> f32 {
    let v = unpack2x16float(word(base + (i >> 1u)));
    return select(v.x, v.y, (i & 1u) != 0u);
}

fn byte_of(v: u32, i: u32) -> u32 {
    return (v >> (8u * i)) & 0xffu;
}

// Bytes 0..15 as signed bytes -8..7 (Q4_0's offset), without borrows between bytes.
fn minus8(v: vec4<u32>) -> vec4<u32> {
    return (v + vec4<u32>(0x78787878u)) ^ vec4<u32>(0x80808080u);
}

// Bytes 0..63 as signed bytes -32..31 (Q6_K's offset).
fn minus32(v: vec4<u32>) -> vec4<u32> {
    return (v + vec4<u32>(0x60606060u)) ^ vec4<u32>(0x80808080u);
}

fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z)
        + dot4I8Packed(a.w, b.w);
}

// The sum of the 32 activation values of a sub-block (the CPU's bsums, two at a time).
fn act_sum(a0: vec4<u32>, a1: vec4<u32>) -> i32 {
    let ones = vec4<u32>(0x01010101u);
    return dot16(a0, ones) + dot16(a1, ones);
}

// The value written for output v of the slot after the reduction: the product (times the
// tensor's scale), or with P = 2 SiLU(gate) * up, stored or added to y as the mode says.
fn finish(idx: u32, v: u32, slot_base: u32) {
    var val = partial[v * WG + slot_base];
    if (P == 2u) {
        let u = partial[(RED + v) * WG + slot_base];
        val = val / (1.0 + exp(-val)) * u;
    }
    val = val * p.scale;
    if ((p.mode & 1u) != 0u) {
        y[idx] = y[idx] + val;
    } else {
        y[idx] = val;
    }
}

fn run(lid: u32, row0: u32, row_lim: u32, wrow_base: u32, xb: array<u32, N>, yb: array<u32, N>) {
    let tpr = 1u << p.tpr_log2;
    let slot = lid >> p.tpr_log2;
    let t = lid & (tpr - 1u);
    let first = row0 + slot * R;
    var wrow: array<u32, R * P>;
    for (var k = 0u; k < R * P; k++) {
        // Rows past the end read the last row and are not written; with P = 2 the up row of
        // gate row r is r + half_rows.
        wrow[k] = wrow_base + min(first + k % R, row_lim - 1u) + (k / R) * p.half_rows;
    }
    var xrow = xb;
    var acc: array<f32, R * P * N>;
    for (var v = 0u; v < R * P * N; v++) {
        acc[v] = 0.0;
    }
    // Unit `c` is part `c % split` of block `c / split`: SUBS / split of its sub-blocks.
    let split = 1u << p.split_log2;
    let subs = SUBS >> p.split_log2;
    for (var c = t; c < p.blocks * split; c += tpr) {
        let u = c >> p.split_log2;
        let j0 = (c & (split - 1u)) * subs;
        var hd: array<Head, R * P>;
        for (var k = 0u; k < R * P; k++) {
            hd[k] = load_head(wrow[k], u);
        }
        var isum: array<i32, R * P * N>;
        var msum: array<i32, R * P * N>;
        for (var v = 0u; v < R * P * N; v++) {
            isum[v] = 0;
            msum[v] = 0;
        }
        for (var j = j0; j < j0 + subs; j++) {
            var ws: array<Sub, R * P>;
            for (var k = 0u; k < R * P; k++) {
                ws[k] = load_sub(wrow[k], u, j, hd[k]);
            }
            for (var i = 0u; i < N; i++) {
                let qa = (xrow[i] >> 2u) + (u * SUBS + j) * 2u;
                let a0 = xq[qa];
                let a1 = xq[qa + 1u];
                var asum = 0;
                if (HAS_MIN) {
                    asum = act_sum(a0, a1);
                }
                for (var k = 0u; k < R * P; k++) {
                    let c = sub_dot(ws[k], a0, a1, asum);
                    isum[k * N + i] += c.x;
                    msum[k * N + i] += c.y;
                }
            }
        }
        for (var i = 0u; i < N; i++) {
            let ad = bitcast<f32>(xword(xrow[i] + p.d_off + u));
            for (var k = 0u; k < R * P; k++) {
                let v = k * N + i;
                acc[v] = block_term(hd[k], ad, isum[v], msum[v], acc[v]);
            }
        }
    }
    var yrow = yb;
    for (var g0 = 0u; g0 < R * N; g0 += RED) {
        var red: array<f32, RED * P>;
        for (var q = 0u; q < P; q++) {
            for (var v = 0u; v < RED; v++) {
                red[q * RED + v] = acc[q * R * N + g0 + v];
            }
        }
        reduce_slot(lid, t, tpr, red);
        for (var v = t; v < RED; v += tpr) {
            let o = g0 + v;
            let r = first + o / N;
            if (r < row_lim) {
                finish(yrow[o % N] + r, v, slot * tpr);
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(WG)
fn matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let row0 = (wid.x + wid.y * nwg.x) * ((WG >> p.tpr_log2) * R);
    if (row0 >= p.rows) {
        return;
    }
    var xb: array<u32, N>;
    var yb: array<u32, N>;
    for (var i = 0u; i < N; i++) {
        let b = p.batch0 + wid.z * N + i;
        xb[i] = b * p.q_stride;
        yb[i] = p.y_off + b * p.y_stride + p.y_row0;
    }
    run(lid, row0, p.rows, 0u, xb, yb);
}
