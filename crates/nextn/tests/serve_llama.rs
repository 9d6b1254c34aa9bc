//! llama-server's own endpoints as its clients use them: `/tokenize`, `/detokenize`,
//! `/apply-template`, `/props`, `/slots`, the native `/completion` (whole and streamed),
//! `/health` and `/v1/health`, any `model` name, and CORS. Field names are those of llama-server's
//! documentation (tools/server/README.md).

mod serve_common;

use serde_json::{json, Value};
use serve_common::Server;

fn keys(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().expect("an object").keys().cloned().collect();
    k.sort();
    k
}

fn has_all(v: &Value, fields: &[&str]) {
    for f in fields {
        assert!(
            v.get(*f).is_some(),
            "'{f}' missing from {}",
            keys(v).join(", ")
        );
    }
}

#[test]
fn llama_server_endpoints_answer_in_its_shapes() {
    let s = Server::start(&["--spec-type", "nextn", "-np", "2", "--temp", "0", "-n", "6"]);

    // /tokenize and /detokenize round-trip; pieces are strings, or bytes when not whole UTF-8.
    let t = s
        .post(
            "/tokenize",
            &json!({"content": "def parse(line):\n    return 1"}),
        )
        .json();
    assert_eq!(keys(&t), ["tokens"]);
    let ids = t["tokens"].clone();
    assert!(ids.as_array().unwrap().iter().all(Value::is_u64));
    let d = s.post("/detokenize", &json!({"tokens": ids})).json();
    assert_eq!(d, json!({"content": "def parse(line):\n    return 1"}));
    let p = s
        .post(
            "/tokenize",
            &json!({"content": "<|im_start|>é", "with_pieces": true}),
        )
        .json();
    let pieces = p["tokens"].as_array().unwrap();
    assert_eq!(pieces[0]["piece"], "<|im_start|>");
    for piece in pieces {
        assert_eq!(keys(piece), ["id", "piece"]);
        assert!(piece["piece"].is_string() || piece["piece"].is_array());
    }
    let plain = s
        .post(
            "/tokenize",
            &json!({"content": "<|im_start|>", "parse_special": false}),
        )
        .json();
    assert!(plain["tokens"].as_array().unwrap().len() > 1);
    assert_eq!(s.post("/tokenize", &json!({"content": 5})).status, 400);
    let r = s.post("/detokenize", &json!({"tokens": [1, 99999999]}));
    assert_eq!(r.status, 400, "{}", r.text());

    // /apply-template gives the text the chat endpoint runs.
    let a = s
        .post(
            "/apply-template",
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .json();
    assert_eq!(keys(&a), ["prompt"]);
    assert!(
        a["prompt"]
            .as_str()
            .unwrap()
            .ends_with("<|im_start|>assistant\n"),
        "{a}"
    );

    // /props: generation defaults from the command line, slots, template, speculative settings.
    let props = s.get("/props").json();
    has_all(
        &props,
        &[
            "default_generation_settings",
            "total_slots",
            "model_path",
            "chat_template",
            "bos_token",
            "eos_token",
            "build_info",
            "modalities",
        ],
    );
    assert_eq!(props["total_slots"], 2);
    let params = &props["default_generation_settings"]["params"];
    assert_eq!(params["temperature"], 0.0);
    assert_eq!(params["n_predict"], 6);
    assert!(props["default_generation_settings"]["n_ctx"].as_u64() > Some(0));
    assert_eq!(props["speculative"]["type"], "nextn");
    assert!(props["chat_template"]
        .as_str()
        .unwrap()
        .contains("im_start"));

    // Native /completion, whole: llama-server's fields; the command line's -n and --temp apply.
    let c = s
        .post(
            "/completion",
            &json!({"prompt": "def fib(n):", "return_tokens": true}),
        )
        .json();
    has_all(
        &c,
        &[
            "content",
            "tokens",
            "stop",
            "id_slot",
            "model",
            "tokens_predicted",
            "tokens_evaluated",
            "generation_settings",
            "prompt",
            "truncated",
            "stop_type",
            "stopping_word",
            "tokens_cached",
            "timings",
        ],
    );
    assert_eq!(c["stop"], true);
    assert_eq!(c["tokens_predicted"], 6);
    assert_eq!(c["stop_type"], "limit");
    assert_eq!(c["tokens"].as_array().unwrap().len(), 6);
    assert_eq!(c["prompt"], "def fib(n):");
    has_all(
        &c["timings"],
        &[
            "prompt_n",
            "prompt_ms",
            "predicted_n",
            "predicted_ms",
            "predicted_per_second",
        ],
    );
    let whole = c["content"].as_str().unwrap().to_string();

    // Streamed: content pieces with stop false, then one object with stop true; the pieces add
    // up to the whole answer. No [DONE] (that is the OpenAI endpoints' end marker).
    let (status, chunks, done) = s.stream(
        "/completion",
        &json!({"prompt": "def fib(n):", "stream": true}),
    );
    assert_eq!(status, 200);
    assert!(!done, "the native stream has no [DONE]");
    let (last, pieces) = chunks.split_last().unwrap();
    assert_eq!(last["stop"], true);
    has_all(last, &["timings", "tokens_predicted", "stop_type"]);
    let text: String = pieces
        .iter()
        .map(|p| {
            assert_eq!(p["stop"], false);
            p["content"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(text, whole);

    // return_tokens: the ids, also on the OpenAI endpoints (in the choice; when streaming, in
    // the last chunk's); a value that is not a boolean is a 400 naming it.
    let oai = s
        .post(
            "/v1/completions",
            &json!({"prompt": "def fib(n):", "return_tokens": true}),
        )
        .json();
    assert_eq!(oai["choices"][0]["tokens"], c["tokens"]);
    let chat = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "return_tokens": true}),
        )
        .json();
    assert_eq!(
        chat["choices"][0]["tokens"].as_array().map(Vec::len),
        chat["usage"]["completion_tokens"]
            .as_u64()
            .map(|n| n as usize)
    );
    let (_, chunks, _) = s.stream(
        "/v1/completions",
        &json!({"prompt": "def fib(n):", "return_tokens": true, "stream": true}),
    );
    let last_choice = chunks
        .iter()
        .rev()
        .find(|c| c["choices"][0]["finish_reason"].is_string())
        .unwrap();
    assert_eq!(last_choice["choices"][0]["tokens"], c["tokens"]);
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": "x", "return_tokens": "yes"}),
    );
    assert_eq!(
        (r.status, r.json()["error"]["param"].clone()),
        (400, json!("return_tokens"))
    );

    // `return_progress`: a stream reports the prompt's processing before the answer, in
    // llama-server's `prompt_progress` shape, on every endpoint; without it, nothing.
    let long_prompt = "def parse(line):\n    return line.split(',')\n".repeat(60);
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2}),
        ),
        (
            "/v1/completions",
            json!({"prompt": long_prompt, "max_tokens": 2}),
        ),
        (
            "/completion",
            json!({"prompt": long_prompt, "n_predict": 2}),
        ),
    ] {
        let mut asked = body.clone();
        asked["stream"] = json!(true);
        asked["return_progress"] = json!(true);
        asked["cache_prompt"] = json!(false);
        let (status, chunks, _) = s.stream(path, &asked);
        assert_eq!(status, 200);
        let progress: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c.get("prompt_progress"))
            .collect();
        assert!(progress.len() >= 3, "{path}: {chunks:?}");
        for p in &progress {
            assert_eq!(
                keys(p),
                ["cache", "processed", "time_ms", "total"],
                "{path}"
            );
        }
        let processed: Vec<u64> = progress
            .iter()
            .map(|p| p["processed"].as_u64().unwrap())
            .collect();
        assert!(
            processed.windows(2).all(|w| w[0] < w[1]),
            "{path}: {processed:?}"
        );
        assert_eq!(processed.first(), Some(&0));
        assert_eq!(
            Some(processed.last().unwrap()),
            progress[0]["total"].as_u64().as_ref()
        );
        // All of it before the answer's first text.
        let first_text = chunks
            .iter()
            .position(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                    || c["choices"][0]["text"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty())
                    || c["content"].as_str().is_some_and(|t| !t.is_empty())
            })
            .unwrap_or(chunks.len());
        let last_progress = chunks
            .iter()
            .rposition(|c| c.get("prompt_progress").is_some());
        assert!(last_progress < Some(first_text), "{path}");
        let mut plain = body.clone();
        plain["stream"] = json!(true);
        let (_, chunks, _) = s.stream(path, &plain);
        assert!(
            chunks.iter().all(|c| c.get("prompt_progress").is_none()),
            "{path}"
        );
    }
    let r = s.post(
        "/completion",
        &json!({"prompt": "x", "stream": true, "return_progress": 1}),
    );
    assert_eq!(
        (r.status, r.json()["error"]["param"].clone()),
        (400, json!("return_progress"))
    );

    // Any model name is answered.
    let r = s.post(
        "/v1/chat/completions",
        &json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    for path in ["/health", "/v1/health"] {
        assert_eq!(s.get(path).json(), json!({"status": "ok"}));
    }
    let slots = s.get("/slots").json();
    for slot in slots.as_array().unwrap() {
        has_all(slot, &["id", "n_ctx", "speculative", "is_processing"]);
    }
}

#[test]
fn cors_preflight_and_origins() {
    let s = Server::start(&["--api-key", "k"]);
    let pre = s.request(
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", "http://chat.example"),
            ("Access-Control-Request-Method", "POST"),
        ],
        b"",
    );
    // Answered before authentication: browsers send no key with a preflight.
    assert_eq!(pre.status, 200);
    assert_eq!(
        pre.header("access-control-allow-origin"),
        Some("http://chat.example")
    );
    assert_eq!(pre.header("access-control-allow-credentials"), Some("true"));
    assert!(pre
        .header("access-control-allow-methods")
        .unwrap()
        .contains("POST"));
    let r = s.request(
        "GET",
        "/v1/models",
        &[
            ("Origin", "http://chat.example"),
            ("Authorization", "Bearer k"),
        ],
        b"",
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://chat.example")
    );

    let local = Server::start(&["--cors-origins", "localhost"]);
    let ok = local.request(
        "GET",
        "/health",
        &[("Origin", "http://localhost:5173")],
        b"",
    );
    assert_eq!(
        ok.header("access-control-allow-origin"),
        Some("http://localhost:5173")
    );
    let other = local.request("GET", "/health", &[("Origin", "http://evil.example")], b"");
    assert_eq!(other.header("access-control-allow-origin"), None);
}
