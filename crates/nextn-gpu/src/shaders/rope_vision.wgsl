// The vision tower's 2D rotary positions (ggml_rope_multi, GGML_ROPE_TYPE_VISION) on the q and k
// parts of fused qkv rows, in place: head pairs (i, i + d/2); pair i < d/4 turns by
// y * scale^i, pair i >= d/4 by x * scale^(i - d/4), the powers built by repeated f32
// multiplication as the CPU builds them. Rows are patches in merge order (2x2 groups row by
// row; inside a group (0,0) (0,1) (1,0) (1,1)) of a grid `nx` patches wide.

struct Params {
    rows: u32,
    n_head: u32,
    d: u32,
    off: u32,
    stride: u32,
    // Elements from a row's q part to its k part.
    k_off: u32,
    nx: u32,
    theta_scale: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;

@compute @workgroup_size(256)
fn rope_vision(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let half = p.d / 2u;
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.rows * p.n_head * half) {
        return;
    }
    let pair = i % half;
    let head = (i / half) % p.n_head;
    let k = i / (half * p.n_head);
    let block = k / 4u;
    let bx = p.nx / 2u;
    let py = 2u * (block / bx) + (k % 4u) / 2u;
    let px = 2u * (block % bx) + k % 2u;
    let quarter = p.d / 4u;
    var theta = f32(py);
    var steps = pair;
    if (pair >= quarter) {
        theta = f32(px);
        steps = pair - quarter;
    }
    for (var s = 0u; s < steps; s++) {
        theta = theta * p.theta_scale;
    }
    let c = cos(theta);
    let sn = sin(theta);
    for (var part = 0u; part < 2u; part++) {
        let at = p.off + k * p.stride + part * p.k_off + head * p.d + pair;
        let x0 = qkv[at];
        let x1 = qkv[at + half];
        qkv[at] = x0 * c - x1 * sn;
        qkv[at + half] = x0 * sn + x1 * c;
    }
}
