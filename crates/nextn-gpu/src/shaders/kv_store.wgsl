// Keys and values of n rows into the cache at positions start_pos.., converted to the cache's
// element types, one invocation per (row, kv head, 64 values). Layout: see kv.rs.
//
// Conversions are exactly the CPU's: f16 rounds to nearest even (half::f16::from_f32), and
// Q8_0 is ggml's quantize_row_q8_0 (d = amax / 127, codes round(x * (1/d)) half away from
// zero). Both divisions are rounded correctly here in integer arithmetic, since WGSL allows
// division 2.5 ulp of error, and the f16 rounding too, since WGSL leaves it to the device.

struct Params {
    n_rows: u32,
    n_kv: u32,
    head_dim: u32,
    capacity: u32,
    start_pos: u32,
    k_off: u32,
    v_off: u32,
    row_stride: u32,
    k_elem: u32,
    v_elem: u32,
    k_scales: u32,
    v_scales: u32,
}

@group(1) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> k_src: array<f32>;
@group(0) @binding(2) var<storage, read> v_src: array<f32>;
@group(0) @binding(3) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(4) var<storage, read_write> v_cache: array<u32>;

// IEEE half bits of x, rounded to nearest even.
fn f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let e = i32((b >> 23u) & 0xffu);
    let m = b & 0x7fffffu;
    if (e == 255) {
        return sign | 0x7c00u | select(0u, 0x200u | (m >> 13u), m != 0u);
    }
    let he = e - 112;
    if (he >= 31) {
        return sign | 0x7c00u;
    }
    if (he <= 0) {
        if (he < -10) {
            return sign;
        }
        let mm = m | 0x800000u;
        let shift = u32(14 - he);
        let half = 1u << (shift - 1u);
        var r = mm >> shift;
        let rem = mm & ((1u << shift) - 1u);
        if (rem > half || (rem == half && (r & 1u) == 1u)) {
            r += 1u;
        }
        return sign | r;
    }
    var r = (u32(he) << 10u) | (m >> 13u);
    let rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u) == 1u)) {
        r += 1u;
    }
    return sign | r;
}

// a / b rounded to nearest even, for a >= 0 and b > 0 normal with a normal quotient; anything
// else (zero, infinities, subnormals) takes the device's division.
fn div_rn(a: f32, b: f32) -> f32 {
    let ab = bitcast<u32>(a);
    let bb = bitcast<u32>(b);
    let ea = i32(ab >> 23u);
    let eb = i32(bb >> 23u);
    if (ea == 0 || ea == 255 || eb == 0 || eb == 255) {
        return a / b;
    }
    let mb = (bb & 0x7fffffu) | 0x800000u;
    var rem = (ab & 0x7fffffu) | 0x800000u;
    var e = ea - eb + 127;
    if (rem < mb) {
        rem = rem << 1u;
        e -= 1;
    }
    // 24 bits of quotient and one more to round by.
    var q = 0u;
    for (var k = 0; k < 25; k++) {
        q = q << 1u;
        if (rem >= mb) {
            rem -= mb;
            q |= 1u;
        }
        rem = rem << 1u;
    }
    let round_bit = q & 1u;
    q = q >> 1u;
    if (round_bit == 1u && (rem != 0u || (q & 1u) == 1u)) {
        q += 1u;
        if (q == 0x1000000u) {
            q = q >> 1u;
            e += 1;
        }
    }
    if (e < 1 || e > 254) {
        return a / b;
    }
    return bitcast<f32>((u32(e) << 23u) | (q & 0x7fffffu));
}

// roundf (half away from zero) of the f32 product v to an integer code, then the x86
// conversion, as the CPU: NaN, infinities and |v| >= 2^31 give i32::MIN. It works on v's bits:
// a float subtraction here could be fused with the product by the compiler, which would round
// the codes of products near a half differently.
fn round_code(v: f32) -> i32 {
    let b = bitcast<u32>(v);
    let e = (b >> 23u) & 0xffu;
    if (e >= 158u) {
        return i32(0x80000000u);
    }
    if (e < 126u) {
        return 0;
    }
    let m = (b & 0x7fffffu) | 0x800000u;
    var mag: u32;
    if (e <= 150u) {
        let shift = 150u - e;
        mag = (m + ((1u << shift) >> 1u)) >> shift;
    } else {
        mag = m << (e - 150u);
    }
    if ((b >> 31u) != 0u) {
        return -i32(mag);
    }
    return i32(mag);
}

// Store 32 values (a Q8_0 block): codes as 8 words; returns the scale's half bits.
fn q8_block(src_base: u32, is_v: bool, code_word: u32) -> u32 {
    var amax = 0.0;
    for (var k = 0u; k < 32u; k++) {
        var x: f32;
        if (is_v) { x = v_src[src_base + k]; } else { x = k_src[src_base + k]; }
        // A NaN compares false and is passed over, as Rust's f32::max does.
        if (abs(x) > amax) {
            amax = abs(x);
        }
    }
    let d = div_rn(amax, 127.0);
    var id = 0.0;
    if (d != 0.0) {
        id = div_rn(1.0, d);
    }
    for (var w = 0u; w < 8u; w++) {
        var word = 0u;
        for (var b = 0u; b < 4u; b++) {
            var x: f32;
            if (is_v) { x = v_src[src_base + 4u * w + b]; } else { x = k_src[src_base + 4u * w + b]; }
            word |= (u32(round_code(x * id)) & 0xffu) << (8u * b);
        }
        if (is_v) { v_cache[code_word + w] = word; } else { k_cache[code_word + w] = word; }
    }
    return f16_bits(d);
}

fn store_side(is_v: bool, elem: u32, src_base: u32, row_pos: u32, d0: u32, len: u32,
              scales: u32) {
    // row_pos = kv_head * capacity + position.
    let hd = p.head_dim;
    let dst = row_pos * hd + d0;
    if (elem == 0u) {
        for (var k = 0u; k < len; k++) {
            var x: f32;
            if (is_v) { x = v_src[src_base + k]; } else { x = k_src[src_base + k]; }
            if (is_v) { v_cache[dst + k] = bitcast<u32>(x); } else { k_cache[dst + k] = bitcast<u32>(x); }
        }
    } else if (elem == 1u) {
        for (var k = 0u; k < len; k += 2u) {
            var a: f32;
            var b: f32;
            if (is_v) {
                a = v_src[src_base + k];
                b = v_src[src_base + k + 1u];
            } else {
                a = k_src[src_base + k];
                b = k_src[src_base + k + 1u];
            }
            let word = f16_bits(a) | (f16_bits(b) << 16u);
            if (is_v) { v_cache[(dst + k) / 2u] = word; } else { k_cache[(dst + k) / 2u] = word; }
        }
    } else {
        let lo = q8_block(src_base, is_v, dst / 4u);
        var hi = 0u;
        if (len > 32u) {
            hi = q8_block(src_base + 32u, is_v, dst / 4u + 8u);
        }
        // Scale words per position: ceil(head_dim / 64); this unit's pair is word d0 / 64.
        let word = scales + row_pos * ((hd + 63u) / 64u) + d0 / 64u;
        if (is_v) { v_cache[word] = lo | (hi << 16u); } else { k_cache[word] = lo | (hi << 16u); }
    }
}

@compute @workgroup_size(64)
fn kv_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let units = (p.head_dim + 63u) / 64u;
    let gid = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (gid >= p.n_rows * p.n_kv * units) {
        return;
    }
    let u = gid % units;
    let rest = gid / units;
    let g = rest % p.n_kv;
    let row = rest / p.n_kv;
    let d0 = u * 64u;
    let len = min(64u, p.head_dim - d0);
    let row_pos = g * p.capacity + p.start_pos + row;
    let src = row * p.row_stride + g * p.head_dim + d0;
    store_side(false, p.k_elem, p.k_off + src, row_pos, d0, len, p.k_scales);
    store_side(true, p.v_elem, p.v_off + src, row_pos, d0, len, p.v_scales);
}
