// dst[dst_off + r*dst_stride + c] = src[src_off + r*src_stride + c] for n rows of width values.
struct Params { n: u32, width: u32, src_off: u32, dst_off: u32, src_stride: u32, dst_stride: u32 }
@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(256)
fn copy_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n * p.width) {
        return;
    }
    let r = i / p.width;
    let c = i % p.width;
    dst[p.dst_off + r * p.dst_stride + c] = src[p.src_off + r * p.src_stride + c];
}
