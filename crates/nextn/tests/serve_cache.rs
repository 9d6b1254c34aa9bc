//! What the server keeps between requests, as clients see it: a slot's state saved to a file and
//! restored in another server process continues exactly as a cold server would; `/slots` shows
//! what each slot holds (images included); damaged, foreign and misnamed slot files are a clear
//! 4xx and leave the server serving; a turn after a `<think>` answer or a tool call resumes from the prefix cache
//! with the answer a cold server gives.

mod serve_common;

use std::path::PathBuf;
use std::process::{Command, Stdio};

use nextn_gguf::Fnv1a;
use serde_json::{json, Value};
use serve_common::{bundled, Server};

fn post(s: &Server, path: &str, body: &Value) -> serve_common::Response {
    s.post(path, body)
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nextn-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn slots(s: &Server) -> Vec<Value> {
    let r = s.get("/slots");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json().as_array().unwrap().clone()
}

/// A prompt whose end is a special token, so that appending text does not change its tokens.
const PROMPT: &str = "<|im_start|>system\nYou write small, correct Python functions with docstrings.<|im_end|>\n<|im_start|>user\nWrite a function that parses a CSV line into fields.<|im_end|>\n";
const NEXT: &str = "<|im_start|>assistant\ndef parse";

fn continuation(extra: Value) -> Value {
    let mut body = json!({
        "prompt": format!("{PROMPT}{NEXT}"),
        "max_tokens": 16,
        "temperature": 0.7,
        "seed": 3,
        "logprobs": 2,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Rewrite a slot file's checksum after editing it, so that only the edit is judged.
fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - 8;
    let mut h = Fnv1a::new();
    h.write(&bytes[..n]);
    bytes[n..].copy_from_slice(&h.finish().to_le_bytes());
}

#[test]
fn a_saved_slot_continues_in_another_server_exactly() {
    let dir = temp_dir("slots");
    let d = dir.to_str().unwrap();
    let a = Server::start(&["--spec-type", "nextn", "-np", "2", "--slot-save-path", d]);
    assert!(slots(&a)
        .iter()
        .all(|s| s["n_past"] == 0 && s["is_processing"] == false));

    // The prompt alone: the slot keeps its state.
    let r = post(
        &a,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let n = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let list = slots(&a);
    assert_eq!(list.len(), 2);
    let held = list
        .iter()
        .find(|s| s["n_past"] == n)
        .expect("a slot holds the prompt");
    let id = held["id"].as_u64().unwrap();
    assert_eq!(held["n_prompt_tokens"], n);
    assert_eq!(held["speculative"], true);

    let r = post(
        &a,
        &format!("/slots/{id}?action=save"),
        &json!({"filename": "conv.bin"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let saved = r.json();
    assert_eq!(saved["n_saved"], n);
    assert_eq!(saved["filename"], "conv.bin");
    let file = dir.join("conv.bin");
    assert_eq!(
        saved["n_written"].as_u64(),
        Some(std::fs::metadata(&file).unwrap().len())
    );
    // The same request on a cold path: the cache bypassed.
    let cold = post(
        &a,
        "/v1/completions",
        &continuation(json!({"cache_prompt": false})),
    )
    .json();
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // Another server (no prefix cache: only the slot's own state can help) restores the file
    // into its slot 1, and the continuation resumes from it with the cold answer.
    let b = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "2",
        "--slot-save-path",
        d,
        "--cache-ram",
        "0",
    ]);
    let r = post(
        &b,
        "/slots/1?action=restore",
        &json!({"filename": "conv.bin"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["n_restored"], n);
    assert_eq!(slots(&b)[1]["n_past"], n);
    let warm = post(&b, "/v1/completions", &continuation(json!({}))).json();
    assert_eq!(warm["usage"]["prompt_tokens_details"]["cached_tokens"], n);
    assert_eq!(warm["timings"]["cache_n"], n);
    assert_eq!(warm["choices"][0]["text"], cold["choices"][0]["text"]);
    assert_eq!(
        warm["choices"][0]["logprobs"],
        cold["choices"][0]["logprobs"]
    );

    // A restored state also goes to the prefix cache: after the slot's own copy is erased,
    // another request still resumes from it.
    let c = Server::start(&["--spec-type", "nextn", "-np", "1", "--slot-save-path", d]);
    let r = post(
        &c,
        "/slots/0?action=restore",
        &json!({"filename": "conv.bin"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(&c, "/slots/0?action=erase", &json!({}));
    assert_eq!(r.json(), json!({"id_slot": 0, "n_erased": n}));
    assert_eq!(slots(&c)[0]["n_past"], 0);
    let from_tree = post(&c, "/v1/completions", &continuation(json!({}))).json();
    assert_eq!(
        from_tree["usage"]["prompt_tokens_details"]["cached_tokens"],
        n
    );
    assert_eq!(
        from_tree["choices"][0]["logprobs"],
        cold["choices"][0]["logprobs"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_slot_files_and_requests_are_refused_and_nothing_else_changes() {
    let dir = temp_dir("slot-errors");
    let d = dir.to_str().unwrap();
    let s = Server::start(&["--spec-type", "nextn", "--slot-save-path", d]);
    let r = post(
        &s,
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 0}),
    );
    assert_eq!(r.status, 200);
    let n = r.json()["usage"]["prompt_tokens"].as_u64();
    let r = post(&s, "/slots/0?action=save", &json!({"filename": "good.bin"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let good = std::fs::read(dir.join("good.bin")).unwrap();

    let mut damaged = good.clone();
    damaged[good.len() / 2] ^= 0x10;
    std::fs::write(dir.join("damaged.bin"), &damaged).unwrap();
    let mut foreign = good.clone();
    foreign[12] ^= 0xff; // the model fingerprint
    reseal(&mut foreign);
    std::fs::write(dir.join("foreign.bin"), &foreign).unwrap();
    std::fs::write(dir.join("text.bin"), b"not a slot file").unwrap();
    std::fs::create_dir_all(dir.join("taken").join("inside")).unwrap();

    let cases: Vec<(String, Value, u16, &str)> = vec![
        (
            "/slots/0?action=restore".into(),
            json!({"filename": "damaged.bin"}),
            400,
            "damaged",
        ),
        (
            "/slots/0?action=restore".into(),
            json!({"filename": "foreign.bin"}),
            400,
            "another model",
        ),
        (
            "/slots/0?action=restore".into(),
            json!({"filename": "text.bin"}),
            400,
            "not a nextn slot file",
        ),
        (
            "/slots/0?action=restore".into(),
            json!({"filename": "missing.bin"}),
            404,
            "cannot read",
        ),
        (
            "/slots/0?action=restore".into(),
            json!({"filename": "../good.bin"}),
            400,
            "invalid filename",
        ),
        (
            "/slots/0?action=save".into(),
            json!({"filename": "a/b.bin"}),
            400,
            "invalid filename",
        ),
        (
            "/slots/0?action=save".into(),
            json!({"filename": 7}),
            400,
            "must be a string",
        ),
        ("/slots/0?action=save".into(), json!({}), 400, "filename"),
        (
            "/slots/0?action=save".into(),
            json!({"filename": "taken"}),
            400,
            "cannot write",
        ),
        (
            "/slots/0?action=load".into(),
            json!({"filename": "good.bin"}),
            400,
            "unknown slot action",
        ),
        (
            "/slots/0".into(),
            json!({"filename": "good.bin"}),
            400,
            "action=",
        ),
        (
            "/slots/x?action=save".into(),
            json!({"filename": "good.bin"}),
            400,
            "invalid slot id",
        ),
        (
            "/slots/5?action=save".into(),
            json!({"filename": "good.bin"}),
            400,
            "does not exist",
        ),
    ];
    for (path, body, status, says) in cases {
        let r = post(&s, &path, &body);
        assert_eq!(r.status, status, "{path} {body}: {}", r.text());
        let message = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains(says), "{path} {body}: {message}");
    }
    // The slot still holds its state and the server still serves.
    assert_eq!(slots(&s)[0]["n_past"].as_u64(), n);
    let r = post(&s, "/v1/completions", &continuation(json!({})));
    assert_eq!(r.status, 200);
    assert!(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
    let r = post(
        &s,
        "/slots/0?action=restore",
        &json!({"filename": "good.bin"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());

    // Without --slot-save-path the actions are not offered.
    let plain = Server::start(&[]);
    // Without --spec-type the load line says how to draft with the file's head.
    assert!(
        plain
            .log_text()
            .contains("the file has a NextN head: --spec-type nextn drafts with it"),
        "{}",
        plain.log_text()
    );
    let r = post(
        &plain,
        "/slots/0?action=save",
        &json!({"filename": "x.bin"}),
    );
    assert_eq!(r.status, 501, "{}", r.text());
    assert!(r.text().contains("--slot-save-path"));
    let n_slots = plain.get("/v1/models").json()["data"][0]["meta"]["n_slots"].as_u64();
    assert_eq!(Some(slots(&plain).len() as u64), n_slots);

    // A save path that cannot be a directory stops the server before it loads anything.
    let out = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(["serve", "--port", "0", "-m"])
        .arg(bundled())
        .args(["--slot-save-path", "/dev/null/slots"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--slot-save-path /dev/null/slots"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A slot whose state holds an image is saved and restored in another server with the same
/// projector: the next request with the same picture resumes after it (the image is not encoded
/// again) with the cold answer, drafting included; a server without that projector refuses the file.
#[test]
fn a_saved_slot_with_an_image_continues_exactly() {
    use base64::Engine as _;
    let dir = temp_dir("slots-image");
    let d = dir.to_str().unwrap();
    let mmproj = dir.join("mmproj.gguf");
    nextn_vision::synth::write_mmproj(&nextn_vision::synth::TowerSpec::fixture(256), &mmproj)
        .expect("write mmproj");
    let mp = mmproj.to_str().unwrap();
    let png = base64::engine::general_purpose::STANDARD.encode(
        std::fs::read(
            nextn_testdata::repo_root().join("crates/nextn-vision/tests/data/ramp-100x75.png"),
        )
        .unwrap(),
    );
    let user = "<|im_start|>user\n<__media__>Describe the picture.<|im_end|>\n";
    let request = |text: String, extra: Value| {
        let mut body = json!({
            "prompt": {"prompt_string": text, "multimodal_data": [png]},
            "n_predict": 12,
            "temperature": 0.7,
            "seed": 3,
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let a = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "1",
        "--mmproj",
        mp,
        "--slot-save-path",
        d,
    ]);
    let r = post(
        &a,
        "/completion",
        &request(user.to_string(), json!({"n_predict": 0})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["timings"]["images_encoded"], 1, "{}", r.text());
    let n = slots(&a)[0]["n_past"].as_u64().unwrap();
    assert!(n > 20, "the image's rows are in the slot: {n}");
    let r = post(
        &a,
        "/slots/0?action=save",
        &json!({"filename": "image.bin"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["n_saved"], n);
    let next = format!("{user}<|im_start|>assistant\n");
    let cold = post(
        &a,
        "/completion",
        &request(next.clone(), json!({"cache_prompt": false})),
    );
    assert_eq!(cold.status, 200, "{}", cold.text());
    let cold = cold.json();
    assert_eq!(cold["timings"]["images_encoded"], 1, "{cold}");

    // Only the slot's own state can help here (no prefix cache).
    let b = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "1",
        "--mmproj",
        mp,
        "--slot-save-path",
        d,
        "--cache-ram",
        "0",
    ]);
    let r = post(
        &b,
        "/slots/0?action=restore",
        &json!({"filename": "image.bin"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["n_restored"], n);
    let warm = post(&b, "/completion", &request(next.clone(), json!({})));
    assert_eq!(warm.status, 200, "{}", warm.text());
    let warm = warm.json();
    assert_eq!(warm["timings"]["cache_n"], n, "{warm}");
    // Timings name images only when some were encoded.
    assert!(warm["timings"].get("images_encoded").is_none(), "{warm}");
    assert_eq!(warm["content"], cold["content"], "{warm}\n{cold}");
    assert!(!cold["content"].as_str().unwrap_or("").is_empty(), "{cold}");

    // Without drafting the head's part of the file is left unread: the same answer.
    let plain = Server::start(&["-np", "1", "--mmproj", mp, "--slot-save-path", d]);
    let r = post(
        &plain,
        "/slots/0?action=restore",
        &json!({"filename": "image.bin"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = post(&plain, "/completion", &request(next.clone(), json!({}))).json();
    assert_eq!(v["timings"]["cache_n"], n, "{v}");
    assert_eq!(v["content"], cold["content"]);

    // Another projector (here: other token bounds), or none, did not encode these rows.
    let other = Server::start(&[
        "--spec-type",
        "nextn",
        "--mmproj",
        mp,
        "--image-max-tokens",
        "64",
        "--slot-save-path",
        d,
    ]);
    let r = post(
        &other,
        "/slots/0?action=restore",
        &json!({"filename": "image.bin"}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains("another vision projector"),
        "{}",
        r.text()
    );
    let blind = Server::start(&["--spec-type", "nextn", "--slot-save-path", d]);
    let r = post(
        &blind,
        "/slots/0?action=restore",
        &json!({"filename": "image.bin"}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("need a vision projector"), "{}", r.text());
    assert_eq!(slots(&blind)[0]["n_past"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Chat turns that follow a reasoning answer and a tool call resume from the prefix cache (the
/// template re-renders the earlier answer, so they resume at the previous prompt's last message)
/// and get exactly the cold server's answer.
#[test]
fn turns_after_thinking_and_tool_calls_resume_exactly() {
    let warm = Server::start(&["--spec-type", "nextn"]);
    let cold = Server::start(&["--spec-type", "nextn", "--cache-ram", "0"]);
    let system =
        json!({"role": "system", "content": "You are a careful coding agent. ".repeat(12)});
    let user = json!({"role": "user", "content": "What is in config.toml?"});
    let tools = json!([{"type": "function", "function": {
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    }}]);
    let turn1 =
        json!({"messages": [system, user], "tools": tools, "max_tokens": 12, "temperature": 0});
    let r = post(&warm, "/v1/chat/completions", &turn1);
    assert_eq!(r.status, 200, "{}", r.text());

    let after_thinking = json!({"messages": [
        system, user,
        {"role": "assistant", "content": "It holds the settings.",
         "reasoning_content": "The user asks about a file. I should answer briefly."},
        {"role": "user", "content": "Show me the first line."}
    ], "tools": tools, "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let after_tool_call = json!({"messages": [
        system, user,
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "read_file", "arguments": "{\"path\": \"config.toml\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "[server]\nport = 8080\n"},
    ], "tools": tools, "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    for body in [after_thinking, after_tool_call] {
        let w = post(&warm, "/v1/chat/completions", &body);
        assert_eq!(w.status, 200, "{}", w.text());
        let w = w.json();
        let c = post(&cold, "/v1/chat/completions", &body).json();
        let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        // At least the system prompt and the first question come from the cache.
        assert!(cached > 60, "{cached}: {w}");
        assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(w["choices"][0]["message"], c["choices"][0]["message"]);
        assert_eq!(w["choices"][0]["logprobs"], c["choices"][0]["logprobs"]);
    }
}

/// A short soak (tools/soak.py): 8 conversations at once on 4 slots, with a prefix cache that
/// holds about 15 snapshots of this model; no request fails, the cache stays within its budget
/// while it evicts and still serves prefixes, and every answer equals the same conversation run
/// alone on a server without the cache.
#[test]
fn a_short_soak_keeps_the_budget_and_matches_one_at_a_time() {
    if let Some(why) = serve_common::missing_python_modules(&["openai"]) {
        // CI installs the client (.ci/run): there a missing one is a failure, not a skip.
        assert!(!nextn_testdata::in_ci(), "required in CI (CI=true): {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let tested = Server::start(&["--spec-type", "nextn", "-np", "4", "--cache-ram", "24"]);
    let reference = Server::start(&["--spec-type", "nextn", "-np", "1", "--cache-ram", "0"]);
    let pid = tested.child.as_ref().unwrap().id().to_string();
    let (url, ref_url) = (
        format!("http://127.0.0.1:{}", tested.port),
        format!("http://127.0.0.1:{}", reference.port),
    );
    let out = serve_common::run_python_tool(
        "soak.py",
        &[
            "--url",
            &url,
            "--ref-url",
            &ref_url,
            "--pid",
            &pid,
            "--conversations",
            "8",
            "--turns",
            "3",
            "--duration",
            "12",
            "--system-words",
            "200",
            "--budget-mib",
            "24",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["errors"], 0, "{report}");
    assert_eq!(report["mismatches"], 0, "{report}");
    assert!(report["conversations"].as_u64() >= Some(8), "{report}");
    assert!(report["evictions"].as_f64() > Some(0.0), "{report}");
    assert!(
        report["cached_prompt_tokens"].as_f64() > Some(0.0),
        "{report}"
    );
    assert!(report["cache_mib_max"].as_f64() <= Some(24.0), "{report}");
    assert!(report["rss_mib_max"].as_f64() > Some(0.0), "{report}");
}
