// The end of a weight product's reduction round (matvec.wgsl and matvec_i8.wgsl), after the
// host's constants and the skeleton: the RED * P partial sums `sums` of thread t of a slot of tpr
// threads (at lid) added over the slot, left at the slot's first thread in partial[v * WG + lid].
// The caller reads them after it, and waits at a barrier before the next round writes partial.
fn reduce_slot(lid: u32, t: u32, tpr: u32, sums: array<f32, RED * P>) {
    var red = sums;
    // The slot's tree: thread t adds thread t + step's sum, step = tpr / 2 down to 1. Steps
    // of LANES or more go through workgroup memory; the rest are within a subgroup, where
    // lane t reads lane t ^ step = t + step by a shuffle: the same pairs, added in the same
    // order, so the same bits as the tree in memory alone (LANES = 1).
    var step = tpr >> 1u;
    if (LANES == 1u || step >= LANES) {
        for (var v = 0u; v < RED * P; v++) {
            partial[v * WG + lid] = red[v];
        }
        workgroupBarrier();
        for (; step >= LANES; step >>= 1u) {
            if (t < step) {
                for (var v = 0u; v < RED * P; v++) {
                    partial[v * WG + lid] = partial[v * WG + lid] + partial[v * WG + lid + step];
                }
            }
            workgroupBarrier();
        }
        for (var v = 0u; v < RED * P; v++) {
            red[v] = partial[v * WG + lid];
        }
    }
    for (; step > 0u; step >>= 1u) {
        for (var v = 0u; v < RED * P; v++) {
            red[v] = red[v] + lane_xor(red[v], step);
        }
    }
    if (LANES > 1u) {
        if (t == 0u) {
            for (var v = 0u; v < RED * P; v++) {
                partial[v * WG + lid] = red[v];
            }
        }
        workgroupBarrier();
    }
}
