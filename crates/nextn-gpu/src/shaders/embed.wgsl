// Rows of the token embedding table on the device, dequantized from the matrix's repacked blocks
// (weights.rs) by the type's own unit decoder (appended, as to matvec.wgsl): the value of column
// c is the decoder's product of the unit that holds c with the one-hot activation e_c, from an
// accumulator of -0, which every decoder forms as ggml's dequantization does (one product by 1.0
// and additions of exact zeros), so a row has the values of the host's dequantized row (a zero may
// come out +0 where the host's is -0: a decoder adds the unit's other half, an exact zero, after
// it).
//
// Ids at or above `device_token` stand for the token a device pass drafted: the id is the first
// word of its (id, logit) pair in `drafts`. An id outside the table (a draft with no token) gives
// a row of zeros, written by the dispatch of the matrix's first buffer. Workgroups: (256 columns,
// row of the gather).

struct Params {
    // The rows of the matrix this buffer holds.
    rows: u32,
    first_row: u32,
    units: u32,
    bpr: u32,
    aux_off: u32,
    aux2_off: u32,
    cols: u32,
    // Rows to gather, their ids from ids_off, the output rows out_stride apart from out_off.
    n: u32,
    ids_off: u32,
    out_off: u32,
    out_stride: u32,
    zero_invalid: u32,
    vocab: u32,
    device_token: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> drafts: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const WG: u32 = 256u;

// The column whose one-hot activation the decoder reads, and whether the unit being loaded
// holds it.
var<private> hot: u32;
var<private> touched: bool;

fn xs(k: u32) -> f32 {
    if (k == hot) {
        touched = true;
        return 1.0;
    }
    return 0.0;
}

fn x4(k: u32) -> vec4<f32> {
    return vec4<f32>(xs(k), xs(k + 1u), xs(k + 2u), xs(k + 3u));
}

fn dot4(a: vec4<f32>, b: vec4<f32>, acc: f32) -> f32 {
    return fma(a.w, b.w, fma(a.z, b.z, fma(a.y, b.y, fma(a.x, b.x, acc))));
}

fn sum4(b: vec4<f32>, acc: f32) -> f32 {
    return (((acc + b.x) + b.y) + b.z) + b.w;
}

fn word(i: u32) -> u32 {
    return w[i >> 2u][i & 3u];
}

fn half_at(base: u32, i: u32) -> f32 {
    let v = unpack2x16float(word(base + (i >> 1u)));
    return select(v.x, v.y, (i & 1u) != 0u);
}

fn byte_of(v: u32, i: u32) -> u32 {
    return (v >> (8u * i)) & 0xffu;
}

fn u8x4(v: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xU8(v));
}

fn i8x4(v: u32) -> vec4<f32> {
    return vec4<f32>(unpack4xI8(v));
}

fn spread4(b: u32) -> u32 {
    return (b * 0x00204081u) & 0x01010101u;
}

@compute @workgroup_size(WG)
fn embed_rows(@builtin(workgroup_id) wid: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    type_init(lid);
    let row = wid.y;
    let c = wid.x * WG + lid;
    if (row >= p.n || c >= p.cols) {
        return;
    }
    var id = ids[p.ids_off + row];
    if (id >= p.device_token) {
        id = drafts[2u * (id - p.device_token)];
    }
    let o = p.out_off + row * p.out_stride + c;
    if (id >= p.vocab) {
        if (p.zero_invalid != 0u) {
            out[o] = 0.0;
        }
        return;
    }
    if (id < p.first_row || id - p.first_row >= p.rows) {
        return;
    }
    hot = c;
    let r = id - p.first_row;
    var v = 0.0;
    for (var u = 0u; u < p.units; u++) {
        touched = false;
        let xu = load_x(0u, u);
        if (touched) {
            v = dot_unit(load_unit(r, u), xu, -0.0);
            break;
        }
    }
    out[o] = v;
}
