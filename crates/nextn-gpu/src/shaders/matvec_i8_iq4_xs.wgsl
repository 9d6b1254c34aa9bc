// IQ4_XS against Q8_K activations: a block is a super-block, its 128 bytes of nibbles (8 vec4),
// its head in two side-array words (f16 d and the u16 of high scale bits; 4 bytes of low scale
// bits). Sub-block j is qs[16j ..][..16]: element l in the low nibble of byte l, l + 16 in its
// high nibble, each an index into ggml's kvalues_iq4nl; its scale the 6-bit value minus 32.
// Term: Σ ls_j Σq·a · (d_a · d_w), as nextn-quant's CPU kernel.

const SUBS: u32 = 8u;
const HAS_MIN: bool = false;

// kvalues_iq4nl as signed bytes, four to a word.
const KVALUES = vec4<u32>(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u);

struct Head {
    d: f32,
    h0: u32,
    sl: u32,
    g: u32,
}

struct Sub {
    q0: vec4<u32>,
    q1: vec4<u32>,
    ls: i32,
}

fn kv(n: u32) -> u32 {
    let t = KVALUES;
    return (t[n >> 2u] >> (8u * (n & 3u))) & 0xffu;
}

// Four nibble indices (one in each byte) to their four signed values.
fn kv4(v: u32) -> u32 {
    return kv(v & 15u) | (kv((v >> 8u) & 15u) << 8u) | (kv((v >> 16u) & 15u) << 16u)
        | (kv(v >> 24u) << 24u);
}

fn kv16(v: vec4<u32>) -> vec4<u32> {
    return vec4<u32>(kv4(v.x), kv4(v.y), kv4(v.z), kv4(v.w));
}

fn load_head(row: u32, u: u32) -> Head {
    let g = row * p.blocks + u;
    let h0 = word(p.aux_off + 2u * g);
    return Head(unpack2x16float(h0).x, h0, word(p.aux_off + 2u * g + 1u), g);
}

fn load_sub(row: u32, u: u32, j: u32, h: Head) -> Sub {
    let q = w[h.g * 8u + j];
    let m = vec4<u32>(0x0f0f0f0fu);
    let sc = ((h.sl >> (4u * j)) & 15u) | (((h.h0 >> (16u + 2u * j)) & 3u) << 4u);
    return Sub(kv16(q & m), kv16((q >> vec4<u32>(4u)) & m), i32(sc) - 32);
}

fn sub_dot(s: Sub, a0: vec4<u32>, a1: vec4<u32>, asum: i32) -> vec2<i32> {
    return vec2<i32>(s.ls * (dot16(s.q0, a0) + dot16(s.q1, a1)), 0);
}

fn block_term(h: Head, ad: f32, isum: i32, msum: i32, acc: f32) -> f32 {
    return fma(f32(isum), ad * h.d, acc);
}
