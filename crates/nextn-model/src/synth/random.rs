//! Deterministic random weights: a small seedable generator and the initialisations the plan uses.
//!
//! Every row of every tensor gets its own generator, seeded from (file seed, tensor name, row), so
//! a file is the same whatever the number of threads or the order rows are produced in.

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Zero-mean, approximately normal with this standard deviation (see [`Rng::gaussian`]).
    Normal { std: f32 },
    /// `center + spread · gaussian`: norm weights (the "+1" of Qwen's RMSNorm already included).
    AroundOne { center: f32, spread: f32 },
    /// `−exp(u)` with `u` uniform in `[lo, hi)`: the negative decay rates `ssm_a`.
    NegExpUniform { lo: f32, hi: f32 },
}

/// xoshiro256** seeded through splitmix64: fast, small state, good enough for weights.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

/// One splitmix64 step: a strong 64-bit mixer, also used to combine seeds.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a tensor name, so each tensor's stream depends on what it is, not where it sits.
pub fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// The seed of one row of one tensor.
pub fn row_seed(file_seed: u64, tensor: u64, row: u64) -> u64 {
    splitmix64(
        splitmix64(file_seed ^ tensor.rotate_left(17)) ^ row.wrapping_mul(0xD1B5_4A32_D192_ED03),
    )
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut s = [0u64; 4];
        for v in &mut s {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            *v = splitmix64(x);
        }
        Rng { s }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Zero mean, unit variance, bell-shaped: the sum of four 16-bit uniforms (Irwin–Hall, n = 4),
    /// rescaled. One generator call per value, which matters for the 27e9 weights of the big
    /// presets; the tails stop at ±2√3 ≈ 3.46σ, which only keeps outliers out of the weights.
    #[inline]
    pub fn gaussian(&mut self) -> f32 {
        let r = self.next_u64();
        let sum = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        // Each term is centred by adding 1/2 (mean of the sum 2·65536), variance 4/12 per 65536².
        const SCALE: f32 = 1.732_050_8 / 65536.0;
        (sum as f32 + 2.0 - 131_072.0) * SCALE
    }
}

impl Init {
    /// Fills one row.
    pub fn fill(&self, rng: &mut Rng, out: &mut [f32]) {
        match *self {
            Init::Normal { std } => out.iter_mut().for_each(|x| *x = std * rng.gaussian()),
            Init::AroundOne { center, spread } => out
                .iter_mut()
                .for_each(|x| *x = center + spread * rng.gaussian()),
            Init::NegExpUniform { lo, hi } => out
                .iter_mut()
                .for_each(|x| *x = -(lo + (hi - lo) * rng.uniform()).exp()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generator_is_deterministic_and_seed_dependent() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let mut r = Rng::new(7);
        assert_eq!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        let mut r = Rng::new(8);
        assert_ne!(a[0], r.next_u64());
        assert_ne!(row_seed(1, 2, 3), row_seed(1, 2, 4));
        assert_ne!(row_seed(1, 2, 3), row_seed(2, 2, 3));
        assert_ne!(
            name_hash("blk.0.attn_q.weight"),
            name_hash("blk.0.attn_k.weight")
        );
    }

    #[test]
    fn gaussian_has_unit_moments() {
        let mut r = Rng::new(42);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| r.gaussian() as f64).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
        assert!(xs.iter().all(|x| x.abs() <= 3.47));
        // Bell-shaped: about 68% within one sigma (uniform would give 58%).
        let within = xs.iter().filter(|x| x.abs() < 1.0).count() as f64 / n as f64;
        assert!((0.66..0.70).contains(&within), "{within}");
    }

    #[test]
    fn inits_have_the_intended_ranges() {
        let mut r = Rng::new(1);
        let mut row = vec![0f32; 1000];
        Init::NegExpUniform { lo: -2.0, hi: 1.0 }.fill(&mut r, &mut row);
        assert!(row
            .iter()
            .all(|&x| x < 0.0 && x > -(1f32.exp()) - 1e-6 && x <= -(-2f32).exp() + 1e-6));
        Init::AroundOne {
            center: 1.0,
            spread: 0.1,
        }
        .fill(&mut r, &mut row);
        assert!(row.iter().all(|&x| (0.6..1.4).contains(&x)));
        Init::Normal { std: 0.5 }.fill(&mut r, &mut row);
        let rms = (row.iter().map(|x| x * x).sum::<f32>() / 1000.0).sqrt();
        assert!((0.45..0.55).contains(&rms), "{rms}");
    }
}
