// dst[i] = src[i] over n 16-byte words: the device's copy bandwidth, the ceiling a profile
// measures each kernel's achieved bandwidth against.
struct Params { n: u32 }
@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<u32>>;

@compute @workgroup_size(256)
fn copy_words(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i < p.n) {
        dst[i] = src[i];
    }
}
