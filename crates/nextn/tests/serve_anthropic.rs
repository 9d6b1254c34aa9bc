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
    // `stream-json` (with --verbose, as SDK hosts run it) asks for `thinking.display: "updates"`:
    // every request of both runs must be answered.
    for format in ["json", "stream-json"] {
        let out = serve_common::run_python_tool(
            "claude_code_check.py",
            &[
                "--url",
                &format!("http://127.0.0.1:{}", s.port),
                "--api-key",
                KEY,
                "--output-format",
                format,
            ],
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("{stdout}");
        assert!(
            out.status.success() && stdout.contains("claude code check passed"),
            "tools/claude_code_check.py --output-format {format} failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
            out.status,
            s.log_text()
        );
    }
    let _ = std::fs::remove_file(&model);
}

/// `thinking.budget_tokens`, `output_config.effort` and the Responses API's `reasoning.effort`
/// bound the thinking block: once spent, the
/// block is closed and the answer follows as a text block (the tiny model never closes a block
/// itself, so without a budget everything is thinking).
#[test]
fn thinking_budgets_and_efforts_close_the_thinking_block() {
    let dir = std::env::temp_dir().join(format!("nextn-anthropic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("thinking.jinja");
    std::fs::write(
        &template,
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}",
    )
    .unwrap();
    let s = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "1",
        "-c",
        "4096",
        "--chat-template-file",
        template.to_str().unwrap(),
        "--reasoning-budget-message",
        " Time to answer.",
    ]);
    let ask = |extra: serde_json::Value| {
        let mut body = json!({"model": "m", "temperature": 0,
            "messages": [{"role": "user", "content": "def add(a, b):"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = s.post("/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let kinds = |v: &serde_json::Value| -> Vec<String> {
        v["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["type"].as_str().unwrap().to_string())
            .collect()
    };
    // An explicit budget wins over the effort (`high`: no cap of its own).
    let v = ask(
        json!({"max_tokens": 1100, "output_config": {"effort": "high"},
        "thinking": {"type": "enabled", "budget_tokens": 1024}}),
    );
    assert_eq!(kinds(&v), ["thinking", "text"], "{v}");
    let thought = v["content"][0]["thinking"].as_str().unwrap();
    assert!(thought.trim_end().ends_with("Time to answer."), "{thought}");
    assert_eq!(v["stop_reason"], "max_tokens");
    // `low` effort: a quarter of max_tokens; `high`: no cap beyond max_tokens.
    let v = ask(json!({"max_tokens": 64, "output_config": {"effort": "low"}}));
    assert_eq!(kinds(&v), ["thinking", "text"], "{v}");
    let v = ask(json!({"max_tokens": 64, "output_config": {"effort": "high"}}));
    assert_eq!(kinds(&v), ["thinking"], "{v}");

    // The Responses API's `reasoning.effort` maps the same way.
    let text_of = |effort: &str| -> String {
        let r = s.post(
            "/v1/responses",
            &json!({"model": "m", "input": "def add(a, b):", "max_output_tokens": 64,
                    "temperature": 0, "reasoning": {"effort": effort}}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["output"][0]["type"], "reasoning", "{v}");
        v["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|item| item["type"] == "message")
            .flat_map(|item| item["content"].as_array().unwrap().clone())
            .filter_map(|part| part["text"].as_str().map(str::to_string))
            .collect()
    };
    assert!(!text_of("low").is_empty());
    assert!(!text_of("medium").is_empty());
    assert_eq!(text_of("high"), "");
}
