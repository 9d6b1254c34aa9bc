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
    }) {
        Ok(g) => Some(g),
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
