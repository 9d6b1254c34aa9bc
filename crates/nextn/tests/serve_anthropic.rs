//! Anthropic's Messages API on `nextn serve`: the official `anthropic` Python client
//! (tools/anthropic_check.py), raw HTTP for its error shapes and for the endpoints a generation
//! model cannot serve, and Claude Code itself in print mode (tools/claude_code_check.py) against
//! a synthesized model with the real Qwen vocabulary and template.

mod serve_common;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;
use serve_common::Server;

const KEY: &str = "sk-anthropic-test";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn anthropic_client_messages_streams_tools_and_errors() {
    if let Some(why) = serve_common::missing_python_modules(&["anthropic"]) {
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
        "4096",
        "--api-key",
        KEY,
    ]);
    let url = format!("http://127.0.0.1:{}", s.port);
    let out =
        serve_common::run_python_tool("anthropic_check.py", &["--url", &url, "--api-key", KEY]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("all anthropic checks passed"),
        "tools/anthropic_check.py failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
}

#[test]
fn messages_errors_and_unserved_endpoints_over_http() {
    let s = Server::start(&["-np", "1", "-c", "1024"]);
    // Anthropic's error shape on the Messages routes, OpenAI's elsewhere.
    let r = s.post(
        "/v1/messages",
        &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"),
        "{v}"
    );
    let r = s.post("/v1/messages/other", &json!({}));
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "not_found_error");
    let r = s.post("/v1/chat/completions", &json!({"messages": []}));
    assert_eq!(r.json()["error"]["code"], 400);
    // A whole answer: the content blocks and usage of the Messages shape.
    let r = s.post(
        "/v1/messages",
        &json!({"model": "m", "max_tokens": 5, "temperature": 0, "thinking": {"type": "disabled"},
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["usage"]["output_tokens"], 5, "{v}");
    assert_eq!(v["stop_reason"], "max_tokens");
    // The endpoints llama-server has that a generation model cannot serve say so.
    for path in [
        "/v1/embeddings",
        "/embeddings",
        "/embedding",
        "/v1/rerank",
        "/rerank",
        "/reranking",
        "/v1/reranking",
        "/v1/audio/transcriptions",
    ] {
        let r = s.post(path, &json!({"input": "x"}));
        assert_eq!(r.status, 501, "{path}");
        let e = r.json();
        assert_eq!(e["error"]["type"], "not_supported_error", "{path}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not served"),
            "{path}: {e}"
        );
    }
}

#[test]
fn claude_code_print_mode_against_a_synth_model() {
    let claude = repo().join("tools/claude_code/node_modules/.bin/claude");
    if !claude.exists() {
        // CI installs it (.ci/run: npm ci --prefix tools/claude_code).
        assert!(
            !nextn_testdata::in_ci(),
            "required in CI (CI=true): Claude Code is not installed in tools/claude_code"
        );
        eprintln!("skipped: Claude Code is not installed (npm ci --prefix tools/claude_code)");
        return;
    }
    let model = std::env::temp_dir().join(format!("nextn-claude-code-{}.gguf", std::process::id()));
    let synth = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args([
            "synth", "--preset", "tiny", "--vocab", "248077", "--ctx", "65536", "--type", "Q8_0",
            "-t", "2", "-o",
        ])
        .arg(&model)
        .output()
        .expect("run nextn synth");
    assert!(
        synth.status.success(),
        "{}",
        String::from_utf8_lossy(&synth.stderr)
    );
    let m = model.to_str().unwrap().to_string();
    let s = Server::start(&["-m", &m, "-np", "1", "-c", "65536", "--api-key", KEY]);
    let out = serve_common::run_python_tool(
        "claude_code_check.py",
        &[
            "--url",
            &format!("http://127.0.0.1:{}", s.port),
            "--api-key",
            KEY,
        ],
    );
    let _ = std::fs::remove_file(&model);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("claude code check passed"),
        "tools/claude_code_check.py failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
}
