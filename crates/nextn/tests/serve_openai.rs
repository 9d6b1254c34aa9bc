//! `nextn serve` through the official `openai` Python client (tools/openai_check.py): chat,
//! streaming chat and completions with an API key, checking content, usage, finish_reason and
//! `timings`. Skipped, with the reason printed, only when python3 or the `openai` module is
//! missing (.ci/run installs the module).

mod serve_common;

use serve_common::Server;

const KEY: &str = "sk-openai-client-test";

#[test]
fn official_openai_python_client() {
    if let Some(why) = serve_common::missing_python_modules(&["openai"]) {
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
    let url = format!("http://127.0.0.1:{}/v1", s.port);
    let out = serve_common::run_python_tool(
        "openai_check.py",
        &[
            "--url",
            &url,
            "--api-key",
            KEY,
            "--expect-model",
            "tiny-alias",
        ],
    );
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
