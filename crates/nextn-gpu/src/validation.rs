//! Messages from the API's validation (the Vulkan validation layer reports through wgpu-hal's
//! log records): tests install this logger, open the device with validation on, and fail on any
//! message at error level from wgpu's crates.

use std::sync::Mutex;

static MESSAGES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, meta: &log::Metadata) -> bool {
        meta.level() <= log::Level::Warn && meta.target().starts_with("wgpu")
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let text = format!("{}: {}", record.target(), record.args());
        // The validation layer's own messages, and wgpu's errors, fail a test; warnings about the
        // loader or the instance (a missing layer manifest, say) are printed only.
        if record.level() == log::Level::Error {
            if let Ok(mut m) = MESSAGES.lock() {
                m.push(text);
            }
        } else {
            eprintln!("{text}");
        }
    }

    fn flush(&self) {}
}

static CAPTURE: Capture = Capture;

/// Route wgpu's log records here (once per process; later calls do nothing).
pub fn install() {
    if log::set_logger(&CAPTURE).is_ok() {
        log::set_max_level(log::LevelFilter::Warn);
    }
}

/// The error-level messages recorded since the last call.
pub fn take() -> Vec<String> {
    MESSAGES
        .lock()
        .map(|mut m| std::mem::take(&mut *m))
        .unwrap_or_default()
}

/// The device for a test, opened with validation on and this logger installed; `None` (after
/// saying so on stderr) on a machine without an adapter, except under `CI=true`, where a missing
/// adapter fails the test: CI installs lavapipe.
#[track_caller]
pub fn test_device() -> Option<crate::Gpu> {
    install();
    let name = std::env::var("NEXTN_TEST_DEVICE")
        .ok()
        .filter(|s| !s.is_empty());
    match crate::Gpu::open(&crate::OpenOptions {
        name,
        validation: true,
        memory_budget: None,
        pipeline_cache_dir: None,
    }) {
        Ok(g) => {
            if let Ok(want) = std::env::var(WIDTH_CHECK_ENV) {
                assert!(
                    g.info.description.contains(&want),
                    "the adapter '{}' does not run at {want}",
                    g.info.description
                );
            }
            Some(g)
        }
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("no GPU adapter under CI=true (install mesa-vulkan-drivers): {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// Fail when the device or the validation layer reported anything since the last check.
#[track_caller]
pub fn assert_clean(gpu: &crate::Gpu) {
    let mut errs = gpu.take_errors();
    errs.extend(take());
    assert!(
        errs.is_empty(),
        "device / validation messages:\n{}",
        errs.join("\n")
    );
}

/// Run every other test of the calling test binary again at each of lavapipe's SIMD widths
/// (4, 8 and 16 lanes: `LP_NATIVE_VECTOR_WIDTH` 128 / 256 / 512, read when the Vulkan instance is
/// created, so each width is a process of its own), and fail unless each run passed and its
/// adapter reported that width. `this_test` is the caller's own name, skipped in the children.
/// Elsewhere than on lavapipe it says so and returns.
#[track_caller]
pub fn rerun_at_lavapipe_widths(this_test: &str) {
    let Some(gpu) = test_device() else { return };
    if !gpu.info.description.contains("llvmpipe") {
        eprintln!(
            "skipped: the adapter is '{}', not lavapipe",
            gpu.info.description
        );
        return;
    }
    drop(gpu);
    let Ok(exe) = std::env::current_exe() else {
        panic!("the test binary's path is unknown");
    };
    for bits in ["128", "256", "512"] {
        let out = std::process::Command::new(&exe)
            .args(["--skip", this_test, "--nocapture", "--test-threads", "1"])
            .env("LP_NATIVE_VECTOR_WIDTH", bits)
            .env("MESA_SHADER_CACHE_DISABLE", "true")
            .env(WIDTH_CHECK_ENV, format!("{bits} bits"))
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "at {bits} bits:\n{text}");
        assert!(
            !text.contains(" 0 passed"),
            "at {bits} bits no test ran:\n{text}"
        );
    }
}

/// Set in the children of [`rerun_at_lavapipe_widths`] to the width the adapter must report;
/// [`test_device`] checks it, so a child cannot pass at the default width.
const WIDTH_CHECK_ENV: &str = "NEXTN_TEST_LAVAPIPE_WIDTH";
