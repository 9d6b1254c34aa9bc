// a[a_off + r*a_stride + c] += b[b_off + r*b_stride + c] for n rows of width values.
struct Params { n: u32, width: u32, a_off: u32, b_off: u32, a_stride: u32, b_stride: u32 }
@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;

@compute @workgroup_size(256)
fn add_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n * p.width) {
        return;
    }
    let r = i / p.width;
    let c = i % p.width;
    a[p.a_off + r * p.a_stride + c] += b[p.b_off + r * p.b_stride + c];
}
