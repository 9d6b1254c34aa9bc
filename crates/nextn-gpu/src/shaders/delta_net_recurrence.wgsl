
// The delta rule over a sequence's rows, one row after another, for every v head m:
//   S <- decay * S;  u = S^T k;  delta = beta * (v - u);  S += k delta^T;  o = scale * S^T q
// with S_m[i][j] (i = key dim, j = value dim) row-major at m * dk * dv, q and k the row's head
// m mod Hk. A workgroup owns 32 value columns of one head; its 128 invocations are 4 parts per
// column, part p holding rows i = p, p + 4, p + 8, ... of the column in private memory for all
// the rows of the batch, so the state is read and written once per call. The column sums are the
// parts' sums (each in increasing i) added part 0 to 3: a fixed order that depends only on dk, so
// a row's result is the same whether it runs alone or in a batch, in place or not.

const PARTS: u32 = 4u;
const COLS: u32 = 32u;
const WG: u32 = 128u;
// Rows of a column per part: dk <= PARTS * ROWS (checked on the host).
const ROWS: u32 = 32u;

var<workgroup> part_u: array<f32, WG>;
var<workgroup> part_o: array<f32, WG>;

@compute @workgroup_size(WG)
fn delta_net_recurrence(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) lid: u32) {
    let tiles = (p.dv + COLS - 1u) / COLS;
    let group = wid.x + wid.y * nwg.x;
    if (group >= p.hv * tiles) {
        return;
    }
    let m = group / tiles;
    let col = lid % COLS;
    let part = lid / COLS;
    let j = (group % tiles) * COLS + col;
    // Columns past dv (a partial last tile) take part in the barriers and write nothing.
    let live = j < p.dv;
    let key_dim = p.hk * p.dk;
    let g = m % p.hk;
    let sb = m * p.dk * p.dv + j;

    var s: array<f32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        let i = r * PARTS + part;
        if (live && i < p.dk) {
            s[r] = state_load(sb + i * p.dv);
        } else {
            s[r] = 0.0;
        }
    }

    for (var t = 0u; t < p.n; t++) {
        let row = t * p.conv_dim;
        let qb = row + g * p.dk;
        let kb = row + key_dim + g * p.dk;
        let dec = decay[t * p.hv + m];
        let bet = beta[t * p.hv + m];
        var u = 0.0;
        for (var r = 0u; r < ROWS; r++) {
            let i = r * PARTS + part;
            if (i < p.dk) {
                s[r] = s[r] * dec;
                u += s[r] * conv[kb + i];
            }
        }
        part_u[lid] = u;
        workgroupBarrier();
        let u_col = ((part_u[col] + part_u[COLS + col]) + part_u[2u * COLS + col]) + part_u[3u * COLS + col];
        var v = 0.0;
        if (live) {
            v = conv[row + 2u * key_dim + m * p.dv + j];
        }
        let delta = bet * (v - u_col);
        var o = 0.0;
        for (var r = 0u; r < ROWS; r++) {
            let i = r * PARTS + part;
            if (i < p.dk) {
                s[r] = s[r] + conv[kb + i] * delta;
                o += s[r] * conv[qb + i];
            }
        }
        part_o[lid] = o;
        // Also orders this row's reads of part_u before the next row's writes.
        workgroupBarrier();
        if (part == 0u && live) {
            let o_col = ((part_o[col] + part_o[COLS + col]) + part_o[2u * COLS + col]) + part_o[3u * COLS + col];
            out[t * p.hv * p.dv + m * p.dv + j] = p.scale * o_col;
        }
    }

    for (var r = 0u; r < ROWS; r++) {
        let i = r * PARTS + part;
        if (live && i < p.dk) {
            state_store(sb + i * p.dv, s[r]);
        }
    }
}
