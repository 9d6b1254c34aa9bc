//! Which SIMD instruction set the kernels use, detected once at run time.

use std::sync::OnceLock;

/// An instruction-set level with its own kernels. Levels on one architecture are ordered:
/// `Scalar < Avx2 < Avx512` on x86-64, `Scalar < Neon` on aarch64.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimdLevel {
    /// Portable code, no SIMD intrinsics (the reference kernels, multithreaded).
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512 F/BW/VL on top of the AVX2 level.
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl SimdLevel {
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Neon => "neon",
        }
    }

    /// Parse a name as `NEXTN_SIMD` spells it (case-insensitive).
    pub fn from_name(name: &str) -> Option<SimdLevel> {
        [
            SimdLevel::Scalar,
            SimdLevel::Avx2,
            SimdLevel::Avx512,
            SimdLevel::Neon,
        ]
        .into_iter()
        .find(|l| l.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this CPU can run this level's kernels.
    pub fn is_supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            SimdLevel::Avx2 => has_avx2(),
            SimdLevel::Avx512 => has_avx2() && has_avx512(),
            SimdLevel::Neon => cfg!(target_arch = "aarch64"),
        }
    }

    /// Every level this CPU supports, lowest first.
    pub fn supported() -> Vec<SimdLevel> {
        [
            SimdLevel::Scalar,
            SimdLevel::Neon,
            SimdLevel::Avx2,
            SimdLevel::Avx512,
        ]
        .into_iter()
        .filter(|l| l.is_supported())
        .collect()
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx2() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx512() -> bool {
    false
}

/// The best level this CPU supports, ignoring `NEXTN_SIMD`.
pub fn detected_simd_level() -> SimdLevel {
    *SimdLevel::supported().last().unwrap_or(&SimdLevel::Scalar)
}

/// The level `QMatrix::mul_rows` uses: the detected one, unless the environment variable
/// `NEXTN_SIMD` (scalar, avx2, avx512, neon) names a lower level this CPU supports. A
/// name that is unknown, unsupported, or higher than the detected level is ignored.
/// Read once per process.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let requested = std::env::var("NEXTN_SIMD").ok();
        choose_level(requested.as_deref(), detected_simd_level())
    })
}

/// The level for an optional `NEXTN_SIMD` value given the detected one.
fn choose_level(requested: Option<&str>, detected: SimdLevel) -> SimdLevel {
    match requested.and_then(SimdLevel::from_name) {
        Some(wanted) if wanted.is_supported() && rank(wanted) <= rank(detected) => wanted,
        _ => detected,
    }
}

fn rank(level: SimdLevel) -> u8 {
    match level {
        SimdLevel::Scalar => 0,
        SimdLevel::Neon | SimdLevel::Avx2 => 1,
        SimdLevel::Avx512 => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for l in [
            SimdLevel::Scalar,
            SimdLevel::Avx2,
            SimdLevel::Avx512,
            SimdLevel::Neon,
        ] {
            assert_eq!(SimdLevel::from_name(l.name()), Some(l));
        }
        assert_eq!(SimdLevel::from_name("AVX2"), Some(SimdLevel::Avx2));
        assert_eq!(SimdLevel::from_name("sse"), None);
    }

    #[test]
    fn environment_can_only_lower_the_level() {
        let detected = detected_simd_level();
        assert_eq!(choose_level(None, detected), detected);
        assert_eq!(choose_level(Some("scalar"), detected), SimdLevel::Scalar);
        assert_eq!(choose_level(Some("bogus"), detected), detected);
        // A level above the detected one (or of another architecture) is ignored.
        assert_eq!(
            choose_level(Some("avx512"), SimdLevel::Scalar),
            SimdLevel::Scalar
        );
        let foreign = if cfg!(target_arch = "aarch64") {
            "avx2"
        } else {
            "neon"
        };
        assert_eq!(choose_level(Some(foreign), detected), detected);
        if SimdLevel::Avx2.is_supported() {
            assert_eq!(choose_level(Some("AVX2"), detected), SimdLevel::Avx2);
        }
    }

    #[test]
    fn chosen_level_is_supported() {
        assert!(simd_level().is_supported());
        assert!(SimdLevel::Scalar.is_supported());
        assert_eq!(
            detected_simd_level(),
            *SimdLevel::supported().last().unwrap()
        );
    }
}
