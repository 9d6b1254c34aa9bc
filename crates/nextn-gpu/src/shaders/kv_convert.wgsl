// The KV cache's conversions, exactly the CPU's: f16 rounds to nearest even
// (half::f16::from_f32), and Q8_0 is ggml's quantize_row_q8_0 (d = amax / 127, codes round(x *
// (1/d)) half away from zero). Both divisions are rounded correctly in integer arithmetic, since
// WGSL allows division 2.5 ulp of error, and the f16 rounding too, since WGSL leaves it to the
// device. Shared by kv_store.wgsl and attention_prep.wgsl.

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

// One Q8_0 block of 32 values: its codes as 8 words and its scale's half bits.
struct Q8Block {
    words: array<u32, 8>,
    d: u32,
}

fn q8_block(x: array<f32, 32>) -> Q8Block {
    var amax = 0.0;
    for (var k = 0u; k < 32u; k++) {
        // A NaN compares false and is passed over, as Rust's f32::max does.
        if (abs(x[k]) > amax) {
            amax = abs(x[k]);
        }
    }
    let d = div_rn(amax, 127.0);
    var id = 0.0;
    if (d != 0.0) {
        id = div_rn(1.0, d);
    }
    var out: Q8Block;
    for (var w = 0u; w < 8u; w++) {
        var word = 0u;
        for (var b = 0u; b < 4u; b++) {
            word |= (u32(round_code(x[4u * w + b] * id)) & 0xffu) << (8u * b);
        }
        out.words[w] = word;
    }
    out.d = f16_bits(d);
    return out;
}
