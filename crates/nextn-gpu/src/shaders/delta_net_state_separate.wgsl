// The delta-rule recurrence reading its state from one buffer and writing it to another (a verify
// batch: the committed state stays as it was). The body follows in delta_net_recurrence.wgsl.

struct Params {
    n: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    conv_dim: u32,
    scale: f32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> state_in: array<f32>;
@group(0) @binding(2) var<storage, read_write> state_out: array<f32>;
@group(0) @binding(3) var<storage, read> conv: array<f32>;
@group(0) @binding(4) var<storage, read> beta: array<f32>;
@group(0) @binding(5) var<storage, read> decay: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

fn state_load(i: u32) -> f32 {
    return state_in[i];
}

fn state_store(i: u32, v: f32) {
    state_out[i] = v;
}
