//! `nextn serve` through the official `openai` Python client (tools/openai_check.py): chat,
//! streaming chat and completions with an API key, checking content, usage, finish_reason and
//! `timings`. Skipped, with the reason printed, only when python3 or the `openai` module is
//! missing (.ci/run installs the module).

mod serve_common;

use std::path::Path;
use std::process::Command;

use serve_common::Server;

const KEY: &str = "sk-openai-client-test";

/// Why the check cannot run here, if it cannot.
fn missing_python_client() -> Option<String> {
    let probe = match Command::new("python3")
        .args(["-c", "import openai"])
        .output()
    {
        Ok(o) => o,
        Err(e) => return Some(format!("python3 not found ({e})")),
    };
    if probe.status.success() {
        return None;
    }
    let err = String::from_utf8_lossy(&probe.stderr);
    // Only an absent module skips: a broken install is a failure worth seeing.
    assert!(
        err.contains("ModuleNotFoundError"),
        "`python3 -c 'import openai'` failed:\n{err}"
    );
    Some("the openai Python module is not installed (.ci/run installs it)".into())
}

#[test]
fn official_openai_python_client() {
    if let Some(why) = missing_python_client() {
        // CI installs the client (.ci/run): there a missing one is a failure, not a skip.
        assert!(!nextn_testdata::in_ci(), "required in CI (CI=true): {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let s = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "2",
        "-c",
        "1024",
        "--api-key",
        KEY,
        "--alias",
        "tiny-alias",
    ]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/openai_check.py");
    let url = format!("http://127.0.0.1:{}/v1", s.port);
    let out = Command::new("python3")
        .arg(&script)
        .args([
            "--url",
            &url,
            "--api-key",
            KEY,
            "--expect-model",
            "tiny-alias",
        ])
        // A proxy from the environment must not intercept loopback traffic, nor settings
        // meant for the real API redirect the client.
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("all_proxy")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .output()
        .expect("run python3 tools/openai_check.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "tools/openai_check.py failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
    assert!(
        stdout.contains("all openai client checks passed"),
        "{stdout}\n{stderr}"
    );
}
