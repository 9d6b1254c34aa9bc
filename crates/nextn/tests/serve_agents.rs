//! What agents and evaluation harnesses need from `nextn serve`: tool calls, structured output,
//! log probabilities, logit bias, and a 400 for what it does not do. Through the official `openai`
//! client (tools/openai_agent_check.py, against a drafting and a plain server) and over raw HTTP.

mod serve_common;

use std::process::Command;

use serde_json::{json, Value};
use serve_common::{bundled, chat, Server};

fn nextn(args: &[&str]) -> Value {
    let o = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .output()
        .expect("run nextn");
    assert!(
        o.status.success(),
        "nextn {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("JSON output")
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id"))
        .collect()
}

#[test]
fn openai_client_tool_calls_structured_output_and_logprobs() {
    if let Some(why) = serve_common::missing_python_modules(&["openai", "jsonschema"]) {
        // CI installs both (.ci/run): there a missing one is a failure, not a skip.
        assert!(!nextn_testdata::in_ci(), "required in CI (CI=true): {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let mtp = Server::start(&["--spec-type", "nextn", "-np", "2", "-c", "4096"]);
    let plain = Server::start(&["--spec-type", "none", "-np", "2", "-c", "4096"]);
    let out = serve_common::run_python_tool(
        "openai_agent_check.py",
        &[
            "--url-mtp",
            &format!("http://127.0.0.1:{}/v1", mtp.port),
            "--url-plain",
            &format!("http://127.0.0.1:{}/v1", plain.port),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("all agent checks passed"),
        "tools/openai_agent_check.py failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        mtp.log_text()
    );
}

/// The log probability of each token is the model's own: `logit - log-sum-exp` of its row,
/// as `nextn logits` computes it, with and without drafting; `top_logprobs` lists the best.
#[test]
fn logprobs_are_those_of_plain_decoding() {
    let m = bundled();
    let m = m.to_str().unwrap();
    let prompt = "def fibonacci(n):\n";
    let run = nextn(&[
        "run", "-m", m, "-p", prompt, "-n", "6", "--temp", "0", "--json",
    ]);
    let prompt_ids = ids(&run["prompt_tokens"]);
    let generated = ids(&run["tokens"]);
    let all: Vec<String> = prompt_ids
        .iter()
        .chain(&generated[..generated.len() - 1])
        .map(u64::to_string)
        .collect();
    let logits = nextn(&[
        "logits",
        "-m",
        m,
        "--tokens",
        &all.join(","),
        "--top-k",
        "5",
        "--json",
    ]);
    let rows = logits["positions"].as_array().expect("positions");
    for args in [
        vec!["--spec-type", "nextn", "--spec-draft-n-max", "3"],
        vec!["--spec-type", "none"],
    ] {
        let s = Server::start(&args);
        let r = s.post(
            "/v1/completions",
            &json!({"prompt": prompt_ids, "max_tokens": 6, "temperature": 0, "logprobs": 5}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let lp = &r.json()["choices"][0]["logprobs"];
        let token_logprobs = lp["token_logprobs"].as_array().expect("token_logprobs");
        assert_eq!(token_logprobs.len(), generated.len());
        for (k, (got, &id)) in token_logprobs.iter().zip(&generated).enumerate() {
            let row = &rows[prompt_ids.len() - 1 + k];
            let top = row["top"].as_array().expect("top");
            // Greedy: the generated token is the row's best.
            assert_eq!(top[0][0].as_u64(), Some(id), "{args:?} token {k}");
            let want = top[0][1].as_f64().unwrap() - row["lse"].as_f64().unwrap();
            let got = got.as_f64().unwrap();
            assert!(
                (got - want).abs() < 1e-4,
                "{args:?} token {k}: {got} vs {want}"
            );
            let alternatives = lp["top_logprobs"][k].as_object().expect("top_logprobs");
            assert!(!alternatives.is_empty() && alternatives.len() <= 5);
        }
        // Chat: the same numbers in the chat shape, 5 alternatives each.
        let r = s.post(
            "/v1/chat/completions",
            &chat(
                "Hi",
                json!({"max_tokens": 4, "temperature": 0, "logprobs": true, "top_logprobs": 5}),
            ),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let content = r.json()["choices"][0]["logprobs"]["content"].clone();
        for t in content.as_array().expect("logprobs.content") {
            assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 5, "{t}");
            assert!(t["bytes"].is_array() && t["token"].is_string());
        }
    }
}

/// A bias of −100 on the token greedy decoding would emit next removes it (by id, and by its
/// text); the next best comes instead.
#[test]
fn logit_bias_removes_the_greedy_token() {
    let s = Server::start(&["--spec-type", "nextn"]);
    let ask = |extra: Value| -> Value {
        let mut body = chat(
            "def parse(self, text):",
            json!({"max_tokens": 1, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
        );
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = s.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["logprobs"]["content"][0].clone()
    };
    let first = ask(json!({}));
    let greedy = first["id"].as_u64().unwrap();
    let second = first["top_logprobs"][1]["id"].as_u64().unwrap();
    let biased = ask(json!({"logit_bias": {greedy.to_string(): -100}}));
    assert_ne!(biased["id"].as_u64(), Some(greedy));
    assert_eq!(biased["id"].as_u64(), Some(second));
    let by_text = ask(json!({"logit_bias": {first["token"].as_str().unwrap(): -100}}));
    assert_ne!(by_text["id"].as_u64(), Some(greedy));
    // The model's own log probabilities are reported, bias or not.
    assert_eq!(biased["top_logprobs"][0]["id"].as_u64(), Some(greedy));
}

#[test]
fn grammars_and_refusals() {
    let s = Server::start(&["--spec-type", "nextn", "--verbose"]);
    // A GBNF grammar (llama.cpp's) and a Lark one (llguidance's) both constrain the output.
    for grammar in [
        "root ::= (\"yes\" | \"no\") \"!\"",
        "start: (\"yes\" | \"no\") \"!\"",
    ] {
        let r = s.post(
            "/v1/chat/completions",
            &chat(
                "Answer:",
                json!({"grammar": grammar, "temperature": 0.7, "seed": 3, "max_tokens": 20}),
            ),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(text == "yes!" || text == "no!", "{grammar}: {text:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(v["timings"]["grammar_masks"].as_u64().unwrap() > 0);
    }
    // llama.cpp's json_schema field, on the completions endpoint too.
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": "x = ", "json_schema": {"type": "integer", "minimum": 0, "maximum": 9},
                "max_tokens": 10, "temperature": 1.0, "seed": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let n: i64 = r.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .trim()
        .parse()
        .expect("an integer");
    assert!((0..=9).contains(&n));

    // A grammar that runs into a dead end (nothing matches an empty character class) is the
    // request's own limit: the output stops cleanly where it ends, on both APIs.
    let dead_end = "start: \"a\" /[^\\s\\S]/";
    let r = s.post(
        "/completion",
        &json!({"prompt": "x", "grammar": dead_end, "n_predict": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["content"], "a");
    assert_eq!(r.json()["stop"], true);
    let r = s.post(
        "/v1/chat/completions",
        &chat(
            "x",
            json!({"grammar": dead_end, "max_tokens": 8, "seed": 5}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["message"]["content"], "a");
    assert_eq!(r.json()["choices"][0]["finish_reason"], "stop");

    for (body, param, needle) in [
        // Known before generation: a grammar that admits no output at all.
        (
            json!({"grammar": "start: /[^\\s\\S]/"}),
            "grammar",
            "grammar does not compile",
        ),
        (
            json!({"grammar": "root ::= (\"x\""}),
            "grammar",
            "GBNF grammar, line 1",
        ),
        (
            json!({"grammar": "start: nowhere"}),
            "grammar",
            "grammar does not compile",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}),
            "response_format",
            "JSON schema does not compile",
        ),
        (
            json!({"logit_bias": {"999999": -5}}),
            "logit_bias",
            "out of range",
        ),
        (json!({"mirostat": 2}), "mirostat", "not supported"),
        (
            json!({"xtc_probability": 0.3}),
            "xtc_probability",
            "not supported",
        ),
        (json!({"n": 2}), "n", "only n = 1"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
            "not one of the request's tools",
        ),
        (
            json!({"tools": [{"type": "code_interpreter"}]}),
            "tools[0]",
            "not supported",
        ),
    ] {
        let mut b = chat("x", json!({"max_tokens": 2}));
        for (k, v) in body.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = s.post("/v1/chat/completions", &b);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    // Unknown fields are ignored, and named once in the debug log.
    let r = s.post(
        "/v1/chat/completions",
        &chat(
            "x",
            json!({"max_tokens": 2, "zz_client_specific": true, "user": "u1"}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        s.log_text().contains("ignores unknown request fields")
            && s.log_text().contains("zz_client_specific"),
        "{}",
        s.log_text()
    );
}

/// Codex CLI (npm `@openai/codex`, which .ci/run installs under tools/codex) in `exec` mode
/// with a custom model provider on the Responses API, against a model with the real Qwen
/// tokenizer and chat template (random weights: the answers are noise, the protocol is what is
/// tested). `--output-schema` makes the grammar end the answer, so the turn completes instead of
/// running into the token budget; thinking is off (`--reasoning-budget 0`) so the JSON is the
/// answer's text. Codex runs with its default configuration, which adds its hosted web search
/// tool: the server leaves it out with a warning. Every request Codex sends must be answered:
/// the run exits 0 with a completed turn, no error event, and a last message that is the
/// schema's JSON.
#[test]
fn codex_cli_exec_over_the_responses_api() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let codex = root.join("tools/codex/node_modules/.bin/codex");
    if !codex.exists() {
        assert!(
            !nextn_testdata::in_ci(),
            "required in CI (CI=true): {} (npm ci --prefix tools/codex)",
            codex.display()
        );
        eprintln!("skipped: Codex CLI not installed (npm ci --prefix tools/codex)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("nextn-codex-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (home, work) = (dir.join("home"), dir.join("work"));
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("notes.txt"), "a file to list\n").unwrap();
    let model = dir.join("synth.gguf");
    let m = model.to_str().unwrap();
    // Codex's instructions and tools take about 10k tokens.
    nextn_ok(&[
        "synth", "--preset", "tiny", "--vocab", "248320", "--ctx", "32768", "--type", "Q8_0", "-o",
        m, "-t", "2",
    ]);
    const KEY: &str = "sk-codex-test";
    let s = Server::start(&[
        "-m",
        m,
        "-c",
        "32768",
        "-np",
        "1",
        "--reasoning-budget",
        "0",
        "--api-key",
        KEY,
    ]);
    // `reasoning.effort` switches the template's thinking: "none" closes the block in the prompt.
    let count = |effort: &str| -> u64 {
        let r = s.request(
            "POST",
            "/v1/responses/input_tokens",
            &[
                ("Content-Type", "application/json"),
                ("Authorization", &format!("Bearer {KEY}")),
            ],
            json!({"input": "Hi", "reasoning": {"effort": effort}})
                .to_string()
                .as_bytes(),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["input_tokens"].as_u64().unwrap()
    };
    assert!(count("none") > count("high"));
    std::fs::write(
        home.join("config.toml"),
        format!(
            "model = \"synth\"\nmodel_provider = \"nextn\"\n\
             [model_providers.nextn]\nname = \"nextn\"\nbase_url = \"http://127.0.0.1:{}/v1\"\n\
             wire_api = \"responses\"\nenv_key = \"NEXTN_TEST_KEY\"\nstream_max_retries = 0\nrequest_max_retries = 0\n",
            s.port
        ),
    )
    .unwrap();
    let schema = dir.join("schema.json");
    let schema_value = json!({
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 16}},
        "required": ["answer"],
        "additionalProperties": false,
    });
    std::fs::write(&schema, schema_value.to_string()).unwrap();
    let last = dir.join("last.txt");
    let child = Command::new(&codex)
        .args(["exec", "--json", "--skip-git-repo-check", "--output-schema"])
        .arg(&schema)
        .arg("--output-last-message")
        .arg(&last)
        .arg("List the files here.")
        .current_dir(&work)
        .env("CODEX_HOME", &home)
        .env("NEXTN_TEST_KEY", KEY)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run codex");
    let out = wait_with_timeout(child, std::time::Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!(
        "codex exit {}\nstdout:\n{stdout}\nstderr:\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
    assert!(out.status.success(), "{context}");
    let events: Vec<Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert!(kinds.contains(&"turn.completed"), "{context}");
    assert!(
        !kinds.iter().any(|k| *k == "error" || *k == "turn.failed"),
        "{context}"
    );
    // The one error item allowed is Codex's own note that it has no metadata for this model.
    assert!(
        events
            .iter()
            .filter(|e| e["item"]["type"] == "error")
            .all(|e| e["item"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("Model metadata for"))),
        "{context}"
    );
    let usage = &events
        .iter()
        .find(|e| e["type"] == "turn.completed")
        .unwrap()["usage"];
    assert!(usage["input_tokens"].as_u64().unwrap() > 1000, "{context}");
    let answer: Value =
        serde_json::from_str(&std::fs::read_to_string(&last).unwrap()).expect("the JSON answer");
    assert!(answer["answer"].is_string(), "{answer} ({context})");
    // Every request Codex made was generated to its end (no budget cut, no failure).
    let log = s.log_text();
    assert!(
        log.contains("is a hosted tool of type 'web_search'"),
        "Codex's default web search tool was expected: {context}"
    );
    let finished: Vec<&str> = log.lines().filter(|l| l.contains(", finish ")).collect();
    assert!(
        !finished.is_empty() && finished.iter().all(|l| !l.contains("finish length")),
        "{context}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn nextn_ok(args: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .output()
        .expect("run nextn");
    assert!(
        o.status.success(),
        "nextn {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The child's output, killing it when it runs past `limit`.
fn wait_with_timeout(
    mut child: std::process::Child,
    limit: std::time::Duration,
) -> std::process::Output {
    use std::io::Read;
    let mut pipes = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = pipes.0.read_to_end(&mut b);
        b
    });
    let err = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = pipes.1.read_to_end(&mut b);
        b
    });
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    std::process::Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}
