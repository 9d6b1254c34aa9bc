// dst row i = src row idx[i] (width values each, rows contiguous).
struct Params { n: u32, width: u32 }
@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> idx: array<u32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(256)
fn gather_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n * p.width) {
        return;
    }
    let r = i / p.width;
    let c = i % p.width;
    dst[i] = src[idx[r] * p.width + c];
}
