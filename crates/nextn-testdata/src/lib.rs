//! Where tests find their reference data.
//!
//! `../shared`, beside the repository root, holds what the tests compare against: llama.cpp's
//! golden fixtures (`golden/`), the tiny model's JAX reference (`models/tiny-qwen35-mtp/`) and the
//! tokenizer sources (`tokenizers/`). It is not part of the repository, so a test asks for the part
//! it needs with [`shared`] and returns early when that gives `None`:
//!
//! ```no_run
//! let Some(golden) = nextn_testdata::shared("golden") else { return };
//! let dir = golden.join("q35-dense-a");
//! # let _ = dir;
//! ```
//!
//! A missing part is skipped with a message on stderr (`skipped: ../shared/golden not found`),
//! except when the environment variable `CI` is `true`: there the golden tests must run, so a
//! missing part panics and names the path it looked at. `NEXTN_SHARED` points at another location
//! of the shared directory.

use std::path::{Path, PathBuf};

/// Environment variable that overrides the location of `../shared`.
pub const SHARED_ENV: &str = "NEXTN_SHARED";

/// Environment variable whose value `true` makes missing reference data an error.
pub const CI_ENV: &str = "CI";

/// The repository root (the workspace directory holding `Cargo.toml` and `models/`).
pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

/// The bundled tiny model, `models/tiny-qwen35-mtp-Q8_0.gguf` (committed, always present).
pub fn bundled_model() -> PathBuf {
    repo_root().join("models/tiny-qwen35-mtp-Q8_0.gguf")
}

/// Where the shared directory is expected, whether or not it exists: `$NEXTN_SHARED` when set
/// and not empty (a relative value is taken from the repository root), otherwise `shared` beside
/// the repository root.
pub fn shared_location() -> PathBuf {
    match std::env::var_os(SHARED_ENV) {
        Some(v) if !v.is_empty() => repo_root().join(v),
        _ => {
            let root = repo_root();
            match root.parent() {
                Some(parent) => parent.join("shared"),
                None => root.join("../shared"),
            }
        }
    }
}

/// The shared directory itself, or `None` after printing `skipped: ../shared not found` when it
/// is missing. Under `CI=true` a missing directory panics instead.
#[track_caller]
pub fn shared_dir() -> Option<PathBuf> {
    lookup(&shared_location(), "", ci_value().as_deref())
}

/// `sub` (a file or directory, e.g. `"golden"` or `"models/tiny-qwen35-mtp"`) inside the shared
/// directory, or `None` after printing `skipped: ../shared/<sub> not found` when it is missing.
/// Under `CI=true` a missing `sub` panics instead.
#[track_caller]
pub fn shared(sub: &str) -> Option<PathBuf> {
    lookup(&shared_location(), sub, ci_value().as_deref())
}

/// Whether missing reference data is an error here (`CI` is `true`).
pub fn in_ci() -> bool {
    is_ci(ci_value().as_deref())
}

/// What a test does with a piece of reference data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// It exists: use it.
    Use,
    /// It is missing outside CI: skip the test with a message.
    Skip,
    /// It is missing under `CI=true`: fail the test.
    Fail,
}

/// `true` when the value of `CI` asks for every golden test to run (`true`, in any letter case).
pub fn is_ci(ci: Option<&str>) -> bool {
    ci.is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// The rule, given the value of `CI` and whether the data exists.
pub fn decide(ci: Option<&str>, exists: bool) -> Decision {
    if exists {
        Decision::Use
    } else if is_ci(ci) {
        Decision::Fail
    } else {
        Decision::Skip
    }
}

/// CPU features every machine this project's CI runs on has: AVX2 (with FMA and F16C) on
/// x86-64. Wider ones (AVX-512, VNNI) differ between machines of the same kind.
pub const CI_CPU_FEATURES: &[&str] = if cfg!(target_arch = "x86_64") {
    &["avx2", "f16c"]
} else {
    &[]
};

/// What a test does when the CPU lacks `feature`, given the value of `CI`: a feature in
/// [`CI_CPU_FEATURES`] fails under `CI=true` (the test would otherwise pass without checking
/// anything); any other is skipped.
pub fn decide_cpu_feature(ci: Option<&str>, feature: &str) -> Decision {
    if is_ci(ci) && CI_CPU_FEATURES.contains(&feature) {
        Decision::Fail
    } else {
        Decision::Skip
    }
}

/// Report that the part `what` of a test does not run because this CPU has no `feature`
/// (`"avx2"`, `"avx512"`, `"vnni"`, ...). The line goes straight to the process's stderr, past the
/// test harness's capture, so a passing run shows what it did not check. Under `CI=true` a
/// feature of [`CI_CPU_FEATURES`] panics instead.
#[track_caller]
pub fn cpu_feature_missing(feature: &str, what: &str) {
    use std::io::Write;
    let line = format!("skipped: {what}: this CPU has no {feature}");
    if decide_cpu_feature(ci_value().as_deref(), feature) == Decision::Fail {
        panic!("{line}, which every CI machine must have (CI=true)");
    }
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `../shared` or `../shared/<sub>`, as messages name it.
fn label(sub: &str) -> String {
    let sub = sub.trim_matches('/');
    if sub.is_empty() {
        "../shared".to_string()
    } else {
        format!("../shared/{sub}")
    }
}

fn ci_value() -> Option<String> {
    std::env::var_os(CI_ENV).map(|v| v.to_string_lossy().into_owned())
}

/// `root/sub` when it exists; otherwise skip or fail according to [`decide`].
#[track_caller]
fn lookup(root: &Path, sub: &str, ci: Option<&str>) -> Option<PathBuf> {
    let rel = sub.trim_matches('/');
    let (path, exists) = if rel.is_empty() {
        (root.to_path_buf(), root.is_dir())
    } else {
        let p = root.join(rel);
        let exists = p.exists();
        (p, exists)
    };
    match decide(ci, exists) {
        Decision::Use => Some(path),
        Decision::Skip => {
            eprintln!("skipped: {} not found", label(sub));
            None
        }
        Decision::Fail => panic!(
            "{} is required in CI (CI=true) but was not found at {} \
             (place the shared directory beside the repository or set {SHARED_ENV})",
            label(sub),
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn present_data_is_used_in_and_out_of_ci() {
        for ci in [None, Some("true"), Some("false"), Some("")] {
            assert_eq!(decide(ci, true), Decision::Use, "CI={ci:?}");
        }
    }

    #[test]
    fn missing_data_fails_only_under_ci_true() {
        assert_eq!(decide(Some("true"), false), Decision::Fail);
        assert_eq!(decide(Some("TRUE"), false), Decision::Fail);
        assert_eq!(decide(Some(" true\n"), false), Decision::Fail);
        for ci in [None, Some(""), Some("false"), Some("0"), Some("yes")] {
            assert_eq!(decide(ci, false), Decision::Skip, "CI={ci:?}");
        }
    }

    #[test]
    fn labels_name_the_part_of_shared() {
        assert_eq!(label(""), "../shared");
        assert_eq!(label("golden"), "../shared/golden");
        assert_eq!(
            label("models/tiny-qwen35-mtp/"),
            "../shared/models/tiny-qwen35-mtp"
        );
    }

    #[test]
    fn lookup_returns_existing_files_and_directories() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        for ci in [None, Some("true")] {
            assert_eq!(lookup(root, "", ci), Some(root.to_path_buf()));
            assert_eq!(lookup(root, "src", ci), Some(root.join("src")));
            assert_eq!(
                lookup(root, "src/lib.rs", ci),
                Some(root.join("src/lib.rs"))
            );
        }
    }

    #[test]
    fn lookup_skips_missing_data_outside_ci() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        assert_eq!(lookup(root, "no-such-dir", None), None);
        assert_eq!(lookup(root, "no-such-dir", Some("false")), None);
        assert_eq!(lookup(&root.join("no-such-dir"), "", None), None);
    }

    #[test]
    #[should_panic(expected = "../shared/golden is required in CI (CI=true) but was not found at")]
    fn lookup_fails_on_missing_data_under_ci() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("no-such-dir");
        lookup(&root, "golden", Some("true"));
    }

    #[test]
    #[should_panic(expected = "../shared is required in CI (CI=true)")]
    fn lookup_fails_on_a_missing_shared_directory_under_ci() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("no-such-dir");
        lookup(&root, "", Some("true"));
    }

    #[test]
    fn locations_are_beside_the_repository() {
        let root = repo_root();
        assert!(root.join("Cargo.toml").is_file(), "{}", root.display());
        assert!(bundled_model().is_file(), "{}", bundled_model().display());
        if std::env::var_os(SHARED_ENV).is_none() {
            assert_eq!(shared_location(), root.parent().unwrap().join("shared"));
        }
    }

    #[test]
    fn a_missing_cpu_feature_fails_under_ci_only_where_every_ci_machine_has_it() {
        for ci in [None, Some("false")] {
            for feature in ["avx2", "avx512", "vnni"] {
                assert_eq!(decide_cpu_feature(ci, feature), Decision::Skip);
            }
        }
        assert_eq!(decide_cpu_feature(Some("true"), "avx512"), Decision::Skip);
        assert_eq!(decide_cpu_feature(Some("true"), "vnni"), Decision::Skip);
        let required = if cfg!(target_arch = "x86_64") {
            Decision::Fail
        } else {
            Decision::Skip
        };
        assert_eq!(decide_cpu_feature(Some("true"), "avx2"), required);
    }
}
