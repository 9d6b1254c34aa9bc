// The sine and cosine of rotary angles without the built-in sin/cos (WGSL only bounds their
// error on [-pi, pi], and angles reach the context length): the angle is reduced modulo pi/2
// exactly in integer arithmetic against 2/pi to 128 bits (Payne-Hanek), then short polynomials on
// [-pi/4, pi/4] give both to about an ulp. Shared by rope_neox.wgsl and attention_prep.wgsl.

// (lo, hi) words of a * b.
fn mul_wide(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let lo = (p00 & 0xffffu) | (mid << 16u);
    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2<u32>(lo, hi);
}

// Bits b .. b+31 of the 192-bit number in words w (least significant first).
fn bits_at(w: array<u32, 6>, b: u32) -> u32 {
    let i = b / 32u;
    let s = b % 32u;
    let lo = w[i] >> s;
    var hi = 0u;
    if (s != 0u && i + 1u < 6u) {
        hi = w[i + 1u] << (32u - s);
    }
    return lo | hi;
}

// sin and cos of r, |r| <= pi/4 (Cephes' sinf / cosf polynomials).
fn sincos_reduced(r: f32) -> vec2<f32> {
    let z = r * r;
    let s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r;
    let c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2)
        * z * z - 0.5 * z + 1.0;
    return vec2<f32>(s, c);
}

// (sin t, cos t) for 0 <= t < 2^32.
fn sincos(t: f32) -> vec2<f32> {
    if (t < 0.78539816) {
        return sincos_reduced(t);
    }
    let bits = bitcast<u32>(t);
    let e = (bits >> 23u) & 0xffu;
    let m = (bits & 0x7fffffu) | 0x800000u;
    // t * 2/pi = m * F * 2^(e - 150 - 128), F = floor(2/pi * 2^128) in four words.
    let f3 = mul_wide(m, 0xF534DDC0u);
    let f2 = mul_wide(m, 0xFC2757D1u);
    let f1 = mul_wide(m, 0x4E441529u);
    let f0 = mul_wide(m, 0xA2F9836Eu);
    var w: array<u32, 6>;
    w[0] = f3.x;
    var s = f3.y + f2.x;
    var c = select(0u, 1u, s < f3.y);
    w[1] = s;
    s = f2.y + f1.x;
    var c2 = select(0u, 1u, s < f2.y);
    let s2 = s + c;
    c2 += select(0u, 1u, s2 < s);
    w[2] = s2;
    s = f1.y + f0.x;
    c = select(0u, 1u, s < f1.y);
    let s3 = s + c2;
    c += select(0u, 1u, s3 < s);
    w[3] = s3;
    w[4] = f0.y + c;
    w[5] = 0u;
    // The binary point sits `point` bits up; e is 126..158 here, so point is 120..152.
    let point = min(278u - e, 160u);
    var quadrant = bits_at(w, point) & 3u;
    var hi = bits_at(w, point - 32u);
    var lo = bits_at(w, point - 64u);
    var sign = 1.0;
    if (hi >= 0x80000000u) {
        // A fraction past one half: the distance to the next multiple of pi/2, negated.
        lo = ~lo + 1u;
        hi = ~hi + select(0u, 1u, lo == 0u);
        sign = -1.0;
        quadrant = (quadrant + 1u) & 3u;
    }
    var shift = 0;
    if (hi == 0u) {
        hi = lo;
        lo = 0u;
        shift = 32;
    }
    let lz = countLeadingZeros(hi);
    var top = hi << lz;
    if (lz != 0u) {
        top = top | (lo >> (32u - lz));
    }
    let frac = ldexp(f32(top), -(32 + shift + i32(lz)));
    let sc = sincos_reduced(sign * frac * 1.5707963267948966);
    switch quadrant {
        case 0u: { return sc; }
        case 1u: { return vec2<f32>(sc.y, -sc.x); }
        case 2u: { return vec2<f32>(-sc.x, -sc.y); }
        default: { return vec2<f32>(-sc.y, sc.x); }
    }
}

