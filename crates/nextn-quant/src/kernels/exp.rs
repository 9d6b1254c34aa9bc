//! The exponential of a softmax's shifted scores, shared by the model's attention and the
//! vision tower's so both compute the same bits on every machine.

/// `e^x` for `x <= 0` (the shifted scores of a softmax), within 2 ulp of the exact value, and 0
/// below −87 where the exact value is under 2⁻¹²⁵. Plain float and integer operations that the
/// compiler vectorises (Cody–Waite reduction by ln 2, Cephes' degree-6 polynomial, the power of
/// two put into the exponent bits), with no fused multiply-add, so every copy gives the same bits.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = if x < -87.0 { -87.0 } else { x };
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let z = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * z + r + 1.0;
    // n in −126..=0: 2ⁿ is a normal float.
    let k = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits(((k + 127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within 2 ulp of the exact exponential over the whole range it is used on, 0 below it.
    #[test]
    fn exp_nonpositive_is_within_two_ulp() {
        let mut worst = 0.0f64;
        for i in 0..=2_000_000u32 {
            let x = -87.0 * i as f32 / 2_000_000.0;
            let exact = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            let ulp = (exact as f32).to_bits();
            let ulp = (f32::from_bits(ulp + 1) - f32::from_bits(ulp)) as f64;
            worst = worst.max((got - exact).abs() / ulp);
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }
}
