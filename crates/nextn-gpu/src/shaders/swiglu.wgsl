// SwiGLU: out[r*width + c] = SiLU(g[g_off + r*g_stride + c]) * u[u_off + r*u_stride + c]. The
// gate and up values may sit in one buffer (a fused gate|up product), bound twice read-only.
struct Params { n: u32, width: u32, g_off: u32, g_stride: u32, u_off: u32, u_stride: u32 }
@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> g: array<f32>;
@group(0) @binding(2) var<storage, read> u: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= p.n * p.width) {
        return;
    }
    let r = i / p.width;
    let c = i % p.width;
    let x = g[p.g_off + r * p.g_stride + c];
    out[i] = x / (1.0 + exp(-x)) * u[p.u_off + r * p.u_stride + c];
}
