// Weight matrix times activation rows, shared by every weight type. The host prepends
// `const N` (activation rows per workgroup), `const R` (weight rows per thread) and `const RED`
// (outputs reduced per round through workgroup memory, a divisor of R * N) and appends
// reduce_slot.wgsl and the type's part: `Unit`, `XUnit`, `type_init`, `load_unit`, `load_x`,
// `dot_unit`.
//
// A workgroup of WG threads is cut into slots of 2^tpr_log2 threads; each slot owns R weight
// rows. Thread t of a slot takes units t, t + tpr, ... of the row (a unit is a fixed run of
// blocks' elements, the same for every row), keeps one partial sum per (weight row, activation
// row), and the slot adds its partials in a fixed tree. tpr depends only on the matrix shape,
// and each (weight row, activation row) pair is computed by the same sequence of operations
// whatever N, R, RED, the slot or the position of the row: a row's result does not depend on the
// batch it is part of.

struct Params {
    // Rows this dispatch covers: the chunk's rows (matvec) or one expert's rows (experts).
    rows: u32,
    units: u32,
    tpr_log2: u32,
    // Blocks per weight row.
    bpr: u32,
    // u32 word offsets of the side arrays in the weight buffer (multiples of 4).
    aux_off: u32,
    aux2_off: u32,
    cols: u32,
    x_off: u32,
    x_stride: u32,
    // x_off and x_stride are multiples of 4: x can be read as vec4.
    x_aligned: u32,
    y_off: u32,
    y_stride: u32,
    // Output row of the chunk's first row (matvec).
    y_row0: u32,
    // First activation row of this dispatch (matvec).
    batch0: u32,
    // Experts.
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
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
// The activations, bound twice: as vec4 for aligned rows, as f32 for the others (a vec4
// view cannot reach the last values of a buffer whose size is not a multiple of 16 bytes).
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> x1: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const WG: u32 = 128u;
var<workgroup> partial: array<f32, WG * RED * P>;

fn xs(k: u32) -> f32 {
    return x1[k];
}

// x[k .. k + 4]; k is a multiple of 4 whenever x_aligned is set.
fn x4(k: u32) -> vec4<f32> {
    if (p.x_aligned != 0u) {
        return x[k >> 2u];
    }
    return vec4<f32>(xs(k), xs(k + 1u), xs(k + 2u), xs(k + 3u));
}

// Explicit fused steps in a fixed order, so that no compiler is free to contract or reorder
// differently from one pipeline to the next.
fn dot4(a: vec4<f32>, b: vec4<f32>, acc: f32) -> f32 {
    return fma(a.w, b.w, fma(a.z, b.z, fma(a.y, b.y, fma(a.x, b.x, acc))));
}

fn sum4(b: vec4<f32>, acc: f32) -> f32 {
    return (((acc + b.x) + b.y) + b.z) + b.w;
}

fn word(i: u32) -> u32 {
    return w[i >> 2u][i & 3u];
}

// Element i of an array of f16 starting at word `base`.
fn half_at(base: u32, i: u32) -> f32 {
    let v = unpack2x16float(word(base + (i >> 1u)));
    return select(v.x, v.y, (i & 1u) != 0u);
}

fn byte_of(v: u32, i: u32) -> u32 {
    return (v >> (8u * i)) & 0xffu;
}

fn u8x4(v: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8(v));
}

fn i8x4(v: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xI8(v));
}

// Bit j of the low 4 bits of b to bit 0 of byte j.
fn spread4(b: u32) -> u32 {
    return (b * 0x00204081u) & 0x01010101u;
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
    type_init(lid);
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
    for (var u = t; u < p.units; u += tpr) {
        var wu: array<Unit, R * P>;
        for (var k = 0u; k < R * P; k++) {
            wu[k] = load_unit(wrow[k], u);
        }
        for (var i = 0u; i < N; i++) {
            let xu = load_x(xrow[i], u);
            for (var k = 0u; k < R * P; k++) {
                acc[k * N + i] = dot_unit(wu[k], xu, acc[k * N + i]);
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
        xb[i] = p.x_off + b * p.x_stride;
        yb[i] = p.y_off + b * p.y_stride + p.y_row0;
    }
    run(lid, row0, p.rows, 0u, xb, yb);
}
