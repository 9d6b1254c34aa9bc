// Each invocation of one 128-wide workgroup writes (subgroup size, index within its subgroup):
// the host checks that every subgroup is a run of consecutive invocations, which the products'
// lane_xor reductions assume.
struct Params {
    unused: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(128)
fn subgroup_probe(@builtin(local_invocation_index) lid: u32,
                  @builtin(subgroup_size) size: u32,
                  @builtin(subgroup_invocation_id) lane: u32) {
    out[2u * lid] = size;
    out[2u * lid + 1u] = lane;
}
