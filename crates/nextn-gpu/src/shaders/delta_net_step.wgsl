// One gated-delta-net layer between its projections, over one sequence's rows, in one dispatch:
// the causal conv + SiLU, the L2 norms of q and k, the gates (beta and decay) and the delta-rule
// recurrence. One workgroup per (v head m, tile of COLS value columns); it computes, row after
// row, the conv of the channels it needs (q and k of head g = m mod Hk, its v columns) from the
// conv window and the raw projections, then updates its columns of the state.
//
// The arithmetic of every value is that of the separate kernels (delta_net_conv.wgsl,
// delta_net_gates.wgsl, delta_net_recurrence.wgsl): the conv's taps summed oldest first, the L2
// norms' sums of squares in the same 128-lane tree, the gates' formulas; the recurrence's column
// sums are PARTS partial sums (each in increasing key index) added part 0 to PARTS - 1. All of
// it depends only on the shape, so a row's result is the same alone or in a batch, in place or
// not, and a replay of kept rows gives the state decoding them one by one would.
//
// The state is read from `states` at `state_off` and the state after the last row written at
// `state_out` (the same offset: in place; another: a verify pass, the committed state left as
// it was); the conv window is read at `window_off` of `windows` and, with bit 2 of `flags`, the
// window after the last row written at `window_out` (another offset of the same buffer). Keeping
// both copies of each in one buffer makes a sequence's bind group the same whichever copy is
// committed. Bit 1 of `flags`: also write the rows' raw projections that a replay needs
// ([q|k|v] channels, beta, alpha: `keep_stride` floats a row) to `keep`. Each raw channel and
// each window channel is written by exactly one workgroup: q and k channels of head g by (m = g,
// tile 0), v channels by their own tile, beta and alpha of head m by (m, tile 0).
//
// Layouts: raw rows `raw_stride` apart from `raw_off`, channels [q (Hk dk) | k (Hk dk) | v (Hv dv)]
// from column 0, beta of head m at column `beta_col + m`, alpha at `alpha_col + m`; the window
// (Kc-1) x conv_dim oldest first; the state Hv x dk x dv with S_m[i][j] at (m dk + i) dv + j;
// `vecs` holds the conv weights (conv_dim x Kc, tap 0 the oldest) from `conv_off`, dt_bias from
// `dt_off`, a from `a_off`; the output o of row t at `o_off + t * o_stride + m dv + j`.

struct Params {
    n: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    kc: u32,
    conv_dim: u32,
    raw_off: u32,
    raw_stride: u32,
    beta_col: u32,
    alpha_col: u32,
    conv_off: u32,
    dt_off: u32,
    a_off: u32,
    o_off: u32,
    o_stride: u32,
    keep_stride: u32,
    flags: u32,
    state_off: u32,
    state_out: u32,
    window_off: u32,
    window_out: u32,
    eps: f32,
    scale: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> raw: array<f32>;
@group(0) @binding(2) var<storage, read> vecs: array<f32>;
@group(0) @binding(3) var<storage, read_write> states: array<f32>;
@group(0) @binding(4) var<storage, read_write> windows: array<f32>;
@group(0) @binding(5) var<storage, read_write> keep: array<f32>;
@group(0) @binding(6) var<storage, read_write> o: array<f32>;

const WG: u32 = 128u;
// The recurrence: PARTS partial sums per value column, COLS columns a workgroup.
const PARTS: u32 = 8u;
const COLS: u32 = 16u;
// Key dims of a column per part: dk <= PARTS * ROWS (checked on the host).
const ROWS: u32 = 16u;
// Rows whose conv and norms are computed together before the recurrence takes them in turn.
const BATCH: u32 = 4u;
const MAX_DK: u32 = 128u;

var<workgroup> qs: array<f32, 512>;     // BATCH * MAX_DK, normed
var<workgroup> ks: array<f32, 512>;
var<workgroup> vs: array<f32, 64>;      // BATCH * COLS
var<workgroup> gate_beta: array<f32, 4>;
var<workgroup> gate_decay: array<f32, 4>;
var<workgroup> sq: array<f32, 1024>;    // 2 * BATCH * WG: squares of q, then of k
var<workgroup> part_u: array<f32, WG>;
var<workgroup> part_o: array<f32, WG>;

// log(1 + e^x) for x <= 20, x otherwise (delta_net_gates.wgsl).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    let e = exp(x);
    let u = 1.0 + e;
    if (u == 1.0) {
        return e;
    }
    return log(u) * (e / (u - 1.0));
}

// Row c of the combined sequence [window (Kc-1 rows), raw rows 0..n], channel ch.
fn combined(c: u32, ch: u32) -> f32 {
    let kc1 = p.kc - 1u;
    if (c < kc1) {
        return windows[p.window_off + c * p.conv_dim + ch];
    }
    return raw[p.raw_off + (c - kc1) * p.raw_stride + ch];
}

// SiLU of the causal conv of channel ch at row t.
fn conv_silu(t: u32, ch: u32) -> f32 {
    var sum = 0.0;
    for (var j = 0u; j < p.kc; j++) {
        sum += combined(t + j, ch) * vecs[p.conv_off + ch * p.kc + j];
    }
    return sum / (1.0 + exp(-sum));
}

fn state_load(i: u32) -> f32 {
    return states[p.state_off + i];
}

fn state_store(i: u32, v: f32) {
    states[p.state_out + i] = v;
}

@compute @workgroup_size(WG)
fn delta_net_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let tiles = (p.dv + COLS - 1u) / COLS;
    let group = wid.x + wid.y * nwg.x;
    if (group >= p.hv * tiles) {
        return;
    }
    let m = group / tiles;
    let tile = group % tiles;
    let col = lid % COLS;
    let part = lid / COLS;
    let j = tile * COLS + col;
    let live = j < p.dv;
    let key_dim = p.hk * p.dk;
    let g = m % p.hk;
    let qk_owner = m == g && tile == 0u;
    let sb = m * p.dk * p.dv + j;
    let save = (p.flags & 2u) != 0u;

    var s: array<f32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        let i = r * PARTS + part;
        if (live && i < p.dk) {
            s[r] = state_load(sb + i * p.dv);
        } else {
            s[r] = 0.0;
        }
    }

    for (var t0 = 0u; t0 < p.n; t0 += BATCH) {
        let nb = min(BATCH, p.n - t0);
        // The conv of this batch's rows: q and k channel lid of head g, the tile's v columns,
        // and the gates of head m; the raw values a replay needs go to `keep`.
        for (var b = 0u; b < nb; b++) {
            let t = t0 + b;
            var yq = 0.0;
            var yk = 0.0;
            if (b < nb && lid < p.dk) {
                let qch = g * p.dk + lid;
                let kch = key_dim + g * p.dk + lid;
                yq = conv_silu(t, qch);
                yk = conv_silu(t, kch);
                if (save && qk_owner) {
                    let kb = t * p.keep_stride;
                    keep[kb + qch] = raw[p.raw_off + t * p.raw_stride + qch];
                    keep[kb + kch] = raw[p.raw_off + t * p.raw_stride + kch];
                }
            }
            qs[b * MAX_DK + lid] = yq;
            ks[b * MAX_DK + lid] = yk;
            sq[(2u * b) * WG + lid] = yq * yq;
            sq[(2u * b + 1u) * WG + lid] = yk * yk;
            if (b < nb && part == 0u && live) {
                let vch = 2u * key_dim + m * p.dv + j;
                vs[b * COLS + col] = conv_silu(t, vch);
                if (save) {
                    keep[t * p.keep_stride + vch] = raw[p.raw_off + t * p.raw_stride + vch];
                }
            }
            if (b < nb && lid == WG - 1u) {
                let rb = p.raw_off + t * p.raw_stride;
                let bv = raw[rb + p.beta_col + m];
                let av = raw[rb + p.alpha_col + m];
                gate_beta[b] = 1.0 / (1.0 + exp(-bv));
                gate_decay[b] = exp(softplus(av + vecs[p.dt_off + m]) * vecs[p.a_off + m]);
                if (save && tile == 0u) {
                    keep[t * p.keep_stride + 2u * key_dim + p.hv * p.dv + m] = bv;
                    keep[t * p.keep_stride + 2u * key_dim + p.hv * p.dv + p.hv + m] = av;
                }
            }
        }
        workgroupBarrier();
        // The sums of squares of q and k of every row of the batch, in one 128-lane tree.
        for (var k = WG / 2u; k > 0u; k >>= 1u) {
            if (lid < k) {
                for (var a = 0u; a < 2u * nb; a++) {
                    sq[a * WG + lid] += sq[a * WG + lid + k];
                }
            }
            workgroupBarrier();
        }
        for (var b = 0u; b < nb; b++) {
            let t = t0 + b;
            let q_scale = 1.0 / max(sqrt(sq[(2u * b) * WG]), p.eps);
            let k_scale = 1.0 / max(sqrt(sq[(2u * b + 1u) * WG]), p.eps);
            let dec = gate_decay[b];
            let bet = gate_beta[b];
            var u = 0.0;
            for (var r = 0u; r < ROWS; r++) {
                let i = r * PARTS + part;
                if (i < p.dk) {
                    s[r] = s[r] * dec;
                    u += s[r] * (ks[b * MAX_DK + i] * k_scale);
                }
            }
            part_u[lid] = u;
            workgroupBarrier();
            var u_col = 0.0;
            for (var q = 0u; q < PARTS; q++) {
                u_col += part_u[q * COLS + col];
            }
            var v = 0.0;
            if (live) {
                v = vs[b * COLS + col];
            }
            let delta = bet * (v - u_col);
            var oo = 0.0;
            for (var r = 0u; r < ROWS; r++) {
                let i = r * PARTS + part;
                if (i < p.dk) {
                    s[r] = s[r] + (ks[b * MAX_DK + i] * k_scale) * delta;
                    oo += s[r] * (qs[b * MAX_DK + i] * q_scale);
                }
            }
            part_o[lid] = oo;
            // Also orders this row's reads of part_u before the next row's writes.
            workgroupBarrier();
            if (part == 0u && live) {
                var o_col = 0.0;
                for (var q = 0u; q < PARTS; q++) {
                    o_col += part_o[q * COLS + col];
                }
                o[p.o_off + t * p.o_stride + m * p.dv + j] = p.scale * o_col;
            }
        }
        // The batch's values are read; the next batch may overwrite them.
        workgroupBarrier();
    }

    for (var r = 0u; r < ROWS; r++) {
        let i = r * PARTS + part;
        if (live && i < p.dk) {
            state_store(sb + i * p.dv, s[r]);
        }
    }

    // The window after the last row: each channel by the workgroup that owns it.
    if ((p.flags & 4u) != 0u) {
        let kc1 = p.kc - 1u;
        for (var r = 0u; r < kc1; r++) {
            if (qk_owner && lid < p.dk) {
                let qch = g * p.dk + lid;
                let kch = key_dim + g * p.dk + lid;
                windows[p.window_out + r * p.conv_dim + qch] = combined(p.n + r, qch);
                windows[p.window_out + r * p.conv_dim + kch] = combined(p.n + r, kch);
            }
            if (part == 0u && live) {
                let vch = 2u * key_dim + m * p.dv + j;
                windows[p.window_out + r * p.conv_dim + vch] = combined(p.n + r, vch);
            }
        }
    }
}
