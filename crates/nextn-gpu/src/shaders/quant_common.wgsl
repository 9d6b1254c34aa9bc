// The activations' quantization arithmetic shared by the kernels that quantize rows for the int8
// products (quantize_q8.wgsl, norm_quant.wgsl, the fused delta-net and attention kernels): the
// CPU's scales bit for bit on every device.

// a / b rounded to nearest (ties to even) by integer long division of the significands, so that
// every device gets the CPU's scales bit for bit: WGSL allows division 2.5 ulp off, compilers
// turn it into a product with a reciprocal, and a fused multiply-add may be two roundings.
// Zeros, subnormals, infinities and results outside the normal range take the device's `a / b`
// (scales of activations never get there).
fn div_rn(a: f32, b: f32) -> f32 {
    let ua = bitcast<u32>(a);
    let ub = bitcast<u32>(b);
    let ea = i32((ua >> 23u) & 0xffu);
    let eb = i32((ub >> 23u) & 0xffu);
    if (ea == 0 || eb == 0 || ea == 255 || eb == 255) {
        return a / b;
    }
    var ma = (ua & 0x7fffffu) | 0x800000u;
    let mb = (ub & 0x7fffffu) | 0x800000u;
    var e = ea - eb + 127;
    if (ma < mb) {
        ma <<= 1u;
        e -= 1;
    }
    // ma / mb in [1, 2): 24 significand bits and a guard bit, the remainder as sticky bit.
    var q = 0u;
    var r = ma;
    for (var i = 0u; i < 25u; i++) {
        q <<= 1u;
        if (r >= mb) {
            r -= mb;
            q |= 1u;
        }
        r <<= 1u;
    }
    var m = q >> 1u;
    if ((q & 1u) != 0u && (r != 0u || (m & 1u) != 0u)) {
        m += 1u;
    }
    if (m == 0x1000000u) {
        m >>= 1u;
        e += 1;
    }
    if (e <= 0 || e >= 255) {
        return a / b;
    }
    return bitcast<f32>(((ua ^ ub) & 0x80000000u) | (u32(e) << 23u) | (m & 0x7fffffu));
}

// A non-negative f32 rounded to the nearest f16 (ties to even), as an f32: the scale ggml
// stores for Q8_0, rounded by bit arithmetic so that no device's f16 conversion mode matters.
fn round_f16(v: f32) -> f32 {
    if (v >= 65520.0) {
        return bitcast<f32>(0x7f800000u);
    }
    if (v < 6.103515625e-05) {
        // f16 subnormals: multiples of 2^-24.
        return round(v * 16777216.0) * 5.9604644775390625e-08;
    }
    let b = bitcast<u32>(v);
    return bitcast<f32>((b + 0x0fffu + ((b >> 13u) & 1u)) & 0xffffe000u);
}


// Quantizing a chunk of 256 values held one by a thread of a 256-thread workgroup, for the
// kernels that produce an activation and quantize it in the same dispatch. Afterwards
// `q_code[i]` is element i's code and `q_d[b]` block b's scale exactly as quantize_q8.wgsl
// makes them from the same values.
const QWG: u32 = 256u;
var<workgroup> q_abs: array<f32, QWG>;
var<workgroup> q_at: array<u32, QWG>;
var<workgroup> q_val: array<f32, QWG>;
var<workgroup> q_code: array<i32, QWG>;
var<workgroup> q_d: array<f32, 8>;

// Whether (b, bi) is the larger magnitude: the larger value, the earlier element on a tie
// (the serial scan keeps the first element of largest magnitude).
fn q_larger(a: f32, ai: u32, b: f32, bi: u32) -> bool {
    return b > a || (b == a && bi < ai);
}

// Every thread calls this in uniform control flow with element `lid` of the chunk (`live`:
// whether the element exists; the last chunk of a row may be short). `kind` 1: one Q8_K block of
// 256; 0: eight Q8_0 blocks of 32 (the block of element i is i / 32).
fn quantize_chunk(lid: u32, v: f32, live: bool, kind: u32) {
    // NaN and zero count as zero, as `abs(v) > amax` passes them over in the serial scan.
    var a = 0.0;
    if (live && abs(v) > 0.0) {
        a = abs(v);
    }
    q_abs[lid] = a;
    q_at[lid] = lid;
    q_val[lid] = v;
    workgroupBarrier();
    // A tree over the whole chunk (Q8_K) or within each 32 (Q8_0): the maximum and where it is
    // do not depend on the order.
    var top = QWG / 2u;
    if (kind == 0u) {
        top = 16u;
    }
    for (var s = top; s > 0u; s >>= 1u) {
        if ((lid % (2u * s)) < s && q_larger(q_abs[lid], q_at[lid], q_abs[lid + s], q_at[lid + s])) {
            q_abs[lid] = q_abs[lid + s];
            q_at[lid] = q_at[lid + s];
        }
        workgroupBarrier();
    }
    var d = 0.0;
    var scale = 0.0;
    if (kind == 0u) {
        let amax = q_abs[lid & ~31u];
        d = round_f16(div_rn(amax, 127.0));
        scale = select(0.0, div_rn(127.0, amax), amax != 0.0);
        var r = round(v * scale);
        q_code[lid] = i32(clamp(r, -128.0, 127.0));
        if ((lid & 31u) == 0u) {
            q_d[lid / 32u] = d;
        }
    } else {
        let amax = q_abs[0];
        if (amax != 0.0) {
            scale = div_rn(-127.0, q_val[q_at[0]]);
            d = div_rn(1.0, scale);
        }
        var r = min(round(v * scale), 127.0);
        q_code[lid] = i32(clamp(r, -128.0, 127.0));
        if (lid == 0u) {
            q_d[0] = d;
        }
    }
    workgroupBarrier();
}

// Word w (4 codes) of the chunk quantize_chunk left.
fn q_word(w: u32) -> u32 {
    return pack4xI8(vec4<i32>(q_code[4u * w], q_code[4u * w + 1u], q_code[4u * w + 2u],
                              q_code[4u * w + 3u]));
}
