//! `nextn serve` through the official `openai` Python client (tools/openai_check.py): chat,
//! streaming chat and completions with an API key, checking content, usage, finish_reason and
//! `timings`. Skipped, with the reason printed, only when python3 or the `openai` module is
//! missing (.ci/run installs the module).

mod serve_common;

use serve_common::Server;

const KEY: &str = "sk-openai-client-test";

#[test]
fn official_openai_python_client() {
    check_with(&[]);
}

/// The same checks with the model on the device (Mesa's lavapipe in CI).
#[test]
fn official_openai_python_client_on_the_device() {
    let list = std::process::Command::new(env!("CARGO_BIN_EXE_nextn"))
        .arg("--list-devices")
        .output()
        .expect("run nextn");
    let listing = String::from_utf8_lossy(&list.stdout).into_owned();
    let Some(dev) = listing
        .lines()
        .filter(|l| l.contains("llvmpipe"))
        .find_map(|l| l.trim().split(':').next().map(str::to_string))
    else {
        assert!(
            !nextn_testdata::in_ci(),
            "no lavapipe adapter under CI=true:\n{listing}"
        );
        eprintln!("skipped: no lavapipe adapter");
        return;
    };
    check_with(&["-dev", &dev]);
}

fn check_with(extra: &[&str]) {
    if let Some(why) = serve_common::missing_python_modules(&["openai"]) {
        // CI installs the client (.ci/run): there a missing one is a failure, not a skip.
        assert!(!nextn_testdata::in_ci(), "required in CI (CI=true): {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let mut args = vec![
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
    ];
    args.extend_from_slice(extra);
    let s = Server::start(&args);
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

/// The Responses API through the official client (tools/openai_responses_check.py): plain and
/// streamed responses validated against the client's types, a forced function call and its
/// `function_call_output` round trip, json_schema output, `previous_response_id` with the
/// prefix cache, retrieve / delete, `input_tokens`, and the refusals.
#[test]
fn official_openai_python_client_responses_api() {
    if let Some(why) = serve_common::missing_python_modules(&["openai", "jsonschema"]) {
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
        "4096",
        "--api-key",
        KEY,
    ]);
    let url = format!("http://127.0.0.1:{}/v1", s.port);
    let out = serve_common::run_python_tool(
        "openai_responses_check.py",
        &["--url", &url, "--api-key", KEY],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("all responses checks passed"),
        "tools/openai_responses_check.py failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
}
