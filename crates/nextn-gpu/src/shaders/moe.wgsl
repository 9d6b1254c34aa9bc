// MoE routing and combination (spec §4.8), one row per workgroup.
//
// route: p = softmax(router logits) over n_expert; the k experts with the largest p (ties to the
// lower index, in descending order of p) and weights p_e / max(sum of the chosen p, 2^-14).
// combine: out = sum_s w_s * y_s (in slot order) + sigmoid(gate) * shared.

// Row r of the logits starts at r * stride.
struct Params { n: u32, n_expert: u32, k: u32, stride: u32 }
@group(1) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> weights: array<f32>;

const MAX_EXPERT: u32 = 512u;
var<workgroup> probs: array<f32, MAX_EXPERT>;

@compute @workgroup_size(1)
fn route(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.n) {
        return;
    }
    let base = row * p.stride;
    var mx = -3.4028235e38;
    for (var e = 0u; e < p.n_expert; e++) {
        mx = max(mx, logits[base + e]);
    }
    var sum = 0.0;
    for (var e = 0u; e < p.n_expert; e++) {
        let v = exp(logits[base + e] - mx);
        probs[e] = v;
        sum += v;
    }
    let inv = 1.0 / sum;
    for (var e = 0u; e < p.n_expert; e++) {
        probs[e] = probs[e] * inv;
    }
    var chosen_sum = 0.0;
    for (var s = 0u; s < p.k; s++) {
        var best = 0u;
        var best_p = -1.0;
        for (var e = 0u; e < p.n_expert; e++) {
            if (probs[e] > best_p) {
                best_p = probs[e];
                best = e;
            }
        }
        ids[row * p.k + s] = best;
        weights[row * p.k + s] = best_p;
        chosen_sum += best_p;
        probs[best] = -2.0;
    }
    let denom = max(chosen_sum, 6.103515625e-5);
    for (var s = 0u; s < p.k; s++) {
        weights[row * p.k + s] = weights[row * p.k + s] / denom;
    }
}
