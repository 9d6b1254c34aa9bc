// One (token, slot) pair of a MoE layer per workgroup along z, as matvec_experts.wgsl, over the
// quantized activation rows. Appended to the N = 1 module so that a row's bits are those of
// `matvec` on the expert's matrix alone.

@group(0) @binding(4) var<storage, read> ids: array<u32>;

var<workgroup> expert_id: u32;

@compute @workgroup_size(WG)
fn matvec_experts(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let row0 = (wid.x + wid.y * nwg.x) * ((WG >> p.tpr_log2) * R);
    if (row0 >= p.rows) {
        return;
    }
    let pair = p.pair0 + wid.z;
    if (lid == 0u) {
        expert_id = ids[p.ids_off + pair];
    }
    let e = workgroupUniformLoad(&expert_id);
    if (e < p.e_base || e - p.e_base >= p.e_count) {
        return;
    }
    let xrow = select(pair / p.n_used, pair, p.x_per_slot != 0u);
    var xb: array<u32, N>;
    var yb: array<u32, N>;
    xb[0] = xrow * p.q_stride;
    yb[0] = p.y_off + pair * p.y_stride;
    run(lid, row0, p.rows, (e - p.e_base) * p.rows, xb, yb);
}
