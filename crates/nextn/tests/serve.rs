//! `nextn serve` as clients see it: the OpenAI endpoints, streaming, errors and hostile input,
//! authentication, the wait queue, a client that goes away, reasoning output and SIGTERM.

mod serve_common;

use std::io::Write;
use std::time::{Duration, Instant};

use nextn_gguf::{GgufFile, GgufWriter};
use serde_json::{json, Value};
use serve_common::{bundled, chat, metric, stream_text, Server};

const KEY: &str = "sk-test-key";

fn auth() -> [(&'static str, &'static str); 2] {
    [
        ("Content-Type", "application/json"),
        ("Authorization", "Bearer sk-test-key"),
    ]
}

fn post(s: &Server, path: &str, body: &Value) -> serve_common::Response {
    s.request("POST", path, &auth(), body.to_string().as_bytes())
}

fn get(s: &Server, path: &str) -> serve_common::Response {
    s.request("GET", path, &auth(), b"")
}

fn stream(s: &Server, path: &str, body: &Value) -> (Vec<Value>, bool) {
    let mut c = s.connect();
    let b = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    );
    c.write_all(head.as_bytes()).unwrap();
    let mut r = std::io::BufReader::new(c);
    let resp = serve_common::read_response(&mut r);
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.header("content-type"), Some("text/event-stream"));
    let body = resp.text();
    let mut chunks = Vec::new();
    let mut done = false;
    for ev in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = ev
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an SSE data event: {ev:?}"));
        if data == "[DONE]" {
            done = true;
        } else {
            assert!(!done, "data after [DONE]");
            chunks.push(serde_json::from_str(data).unwrap());
        }
    }
    (chunks, done)
}

#[test]
fn openai_endpoints_errors_and_metrics() {
    let s = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "2",
        "-c",
        "512",
        "--api-key",
        KEY,
        "--alias",
        "tiny",
        "--max-body-size",
        "20000",
    ]);
    // Calibration keeps the server in "loading" for a while after it starts listening.
    assert_eq!(s.first_health, 503);
    assert_eq!(s.get("/health").json()["status"], "ok");

    // Authentication: /health is public, everything else needs the key.
    for (headers, want) in [
        (vec![], 401),
        (vec![("Authorization", "Bearer wrong")], 401),
        (vec![("Authorization", "Bearer sk-test-key")], 200),
        (vec![("x-api-key", "sk-test-key")], 200),
    ] {
        let r = s.request("GET", "/v1/models", &headers, b"");
        assert_eq!(r.status, want, "{headers:?}: {}", r.text());
        if want == 401 {
            assert_eq!(r.json()["error"]["type"], "authentication_error");
        }
    }
    let models = get(&s, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["meta"]["n_ctx_slot"], 256);

    // Non-streaming chat: shape, usage, timings, determinism at temperature 0.
    let body = chat("def fib(n):", json!({"model": "tiny", "max_tokens": 20}));
    let a = post(&s, "/v1/chat/completions", &body);
    assert_eq!(a.status, 200, "{}", a.text());
    let a = a.json();
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    let content = a["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!content.is_empty());
    assert_eq!(a["usage"]["completion_tokens"], 20);
    assert_eq!(
        a["usage"]["total_tokens"],
        a["usage"]["prompt_tokens"].as_u64().unwrap() + 20
    );
    for f in [
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_token_ms",
        "predicted_per_second",
        "cache_n",
        "draft_n",
        "draft_n_accepted",
    ] {
        assert!(
            a["timings"].get(f).is_some(),
            "timings.{f} missing: {}",
            a["timings"]
        );
    }
    assert_eq!(a["timings"]["predicted_n"], 20);
    let again = post(&s, "/chat/completions", &body).json();
    assert_eq!(again["choices"][0]["message"]["content"], content.as_str());

    // The file name is accepted as a model name too; another model is not.
    assert_eq!(
        post(
            &s,
            "/v1/chat/completions",
            &chat(
                "x",
                json!({"model": "tiny-qwen35-mtp-Q8_0.gguf", "max_tokens": 1})
            )
        )
        .status,
        200
    );
    // Any model name is answered, as llama-server does (clients hard-code names).
    let r = post(
        &s,
        "/v1/chat/completions",
        &chat("x", json!({"model": "gpt-4o-mini", "max_tokens": 1})),
    );
    assert_eq!(r.status, 200, "{}", r.text());

    // Streaming chat gives the same text, a role chunk first, a finish chunk with timings,
    // the usage chunk, then [DONE].
    let (chunks, done) = stream(
        &s,
        "/v1/chat/completions",
        &chat(
            "def fib(n):",
            json!({"max_tokens": 20, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    assert!(done);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
    assert_eq!(stream_text(&chunks, "content"), content);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert_eq!(finish["timings"]["predicted_n"], 20);
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 20);

    // Completions: text and token prompts, streaming and not.
    let c = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "import os\nimport sys\n", "max_tokens": 12, "temperature": 0}),
    )
    .json();
    assert_eq!(c["object"], "text_completion");
    let text = c["choices"][0]["text"].as_str().unwrap().to_string();
    let (chunks, done) = stream(
        &s,
        "/v1/completions",
        &json!({"prompt": ["import os\nimport sys\n"], "max_tokens": 12, "temperature": 0, "stream": true}),
    );
    assert!(done);
    assert_eq!(stream_text(&chunks, "content"), text);
    // max_tokens 0 only processes the prompt.
    let t = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "import os\nimport sys\n", "max_tokens": 0}),
    )
    .json();
    assert_eq!(
        (
            t["usage"]["completion_tokens"].clone(),
            t["choices"][0]["text"].clone()
        ),
        (json!(0), json!(""))
    );
    assert_eq!(t["choices"][0]["finish_reason"], "length");
    let by_ids = post(
        &s,
        "/v1/completions",
        &json!({"prompt": [11, 12, 13], "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(by_ids.status, 200);
    assert_eq!(by_ids.json()["usage"]["prompt_tokens"], 3);

    // A stop string ends the text before it, with finish_reason "stop".
    let cut = text
        .char_indices()
        .nth(text.chars().count() / 2)
        .map(|(i, _)| i)
        .unwrap();
    let stop: String = text[cut..].chars().take(3).collect();
    let st = post(&s, "/v1/completions", &json!({"prompt": "import os\nimport sys\n", "max_tokens": 12, "temperature": 0, "stop": [stop]})).json();
    let got = st["choices"][0]["text"].as_str().unwrap();
    assert_eq!(st["choices"][0]["finish_reason"], "stop");
    assert_eq!(got, &text[..text.find(stop.as_str()).unwrap()]);

    // Errors, each with the OpenAI shape and the right status.
    let long_prompt = "word ".repeat(400);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "/v1/chat/completions",
            b"{not json".to_vec(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            b"[1,2]".to_vec(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            b"\xff\xfe\x00".to_vec(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string().into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"temperature": -1}))
                .to_string()
                .into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": "many"}))
                .to_string()
                .into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            chat("x", json!({"max_tokens": 1e300}))
                .to_string()
                .into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n_probs": "lots"})
                .to_string()
                .into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "mirostat": 2})
                .to_string()
                .into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            chat(&long_prompt, json!({})).to_string().into_bytes(),
            400,
            "exceed_context_size_error",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 99999]}).to_string().into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}).to_string().into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            format!("{}{}", "[".repeat(5000), "]".repeat(5000)).into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            vec![b' '; 30_000],
            413,
            "invalid_request_error",
        ),
        ("/v1/nothing", b"{}".to_vec(), 404, "not_found_error"),
    ];
    for (path, body, status, kind) in cases {
        let r = s.request("POST", path, &auth(), &body);
        assert_eq!(
            r.status,
            status,
            "{path} {:?}: {}",
            String::from_utf8_lossy(&body[..body.len().min(60)]),
            r.text()
        );
        let e = r.json();
        assert_eq!(e["error"]["type"], kind, "{}", r.text());
        assert_eq!(e["error"]["code"], status);
    }
    let r = s.request("GET", "/v1/chat/completions", &auth(), b"");
    assert_eq!(r.status, 405);
    let r = post(&s, "/v1/chat/completions", &chat(&long_prompt, json!({})));
    assert_eq!(r.json()["error"]["n_ctx"], 256);

    // Garbage on the socket does not take the server down.
    for junk in [
        &b"GARBAGE\r\n\r\n"[..],
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pro",
        b"\x00\x01\x02\x03",
    ] {
        let mut c = s.connect();
        let _ = c.write_all(junk);
        drop(c);
    }
    assert_eq!(s.get("/health").status, 200);

    // The counters add up to what the clients received.
    let m = get(&s, "/metrics").text();
    assert!(metric(&m, "llamacpp:tokens_predicted_total") >= 20.0 * 3.0);
    assert!(metric(&m, "llamacpp:prompt_tokens_total") > 0.0);
    assert_eq!(metric(&m, "llamacpp:requests_processing"), 0.0);
    let drafts = metric(&m, "llamacpp:spec_decode_num_draft_tokens_total");
    let accepted = metric(&m, "llamacpp:spec_decode_num_accepted_tokens_total");
    let pos0 = metric(
        &m,
        "llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}",
    );
    let steps = metric(&m, "llamacpp:spec_decode_num_drafts_total");
    assert!(accepted <= drafts && pos0 <= steps && pos0 <= accepted);
}

#[test]
fn queue_disconnect_and_sigterm() {
    let mut s = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "1",
        "--max-queue",
        "1",
        "--shutdown-grace",
        "0.5",
    ]);
    let long = chat(
        "class Stack:",
        json!({"max_tokens": 100000, "stream": true}),
    );
    let (status, mut first) = s.open_stream("/v1/chat/completions", &long);
    assert_eq!(status, 200);
    for _ in 0..3 {
        assert!(first.next_event().is_some());
    }
    // The only slot is busy: one request waits, the next is refused.
    let port = s.port;
    let waiting = std::thread::spawn(move || {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let b = chat("x = 1", json!({"max_tokens": 4})).to_string();
        write!(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{b}", b.len()).unwrap();
        serve_common::read_response(&mut std::io::BufReader::new(c))
    });
    let t0 = Instant::now();
    while s.metric("llamacpp:requests_deferred") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the second request never queued"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let refused = s.post("/v1/chat/completions", &chat("y", json!({})));
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.json()["error"]["type"], "unavailable_error");

    // The streaming client goes away: its slot serves the waiting request at once.
    drop(first);
    let done = waiting.join().unwrap();
    assert_eq!(done.status, 200, "{}", done.text());
    assert_eq!(done.json()["usage"]["completion_tokens"], 4);
    assert!(t0.elapsed() < Duration::from_secs(30));
    let m = s.metrics();
    assert_eq!(metric(&m, "nextn:requests_cancelled_total"), 1.0);
    assert_eq!(metric(&m, "llamacpp:requests_processing"), 0.0);

    // SIGTERM with a stream running: the stream ends, the process exits cleanly.
    let (status, mut running) = s.open_stream("/v1/chat/completions", &long);
    assert_eq!(status, 200);
    assert!(running.next_event().is_some());
    let exit = s.terminate(Duration::from_secs(30));
    assert!(exit.success(), "exit status {exit}; log:\n{}", s.log_text());
    let mut last = None;
    while let Some(ev) = running.next_event() {
        last = Some(ev);
    }
    let last = last.expect("the stream carried events up to the end");
    assert!(last.contains("shutting down") || last == "[DONE]", "{last}");
    assert!(s.log_text().contains("server stopped"));
}

/// The bundled model with a chat template that opens a thinking block, as Qwen templates do with
/// `enable_thinking`.
fn thinking_model() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("nextn-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("thinking.gguf");
    let f = GgufFile::open(bundled()).unwrap();
    let mut w = GgufWriter::from_file(&f);
    let template = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}";
    w.set_kv("tokenizer.chat_template", template);
    w.discard_preserved_layout();
    w.write_file(&path).unwrap();
    path
}

#[test]
fn reasoning_content_with_deepseek_format() {
    let model = thinking_model();
    let s = Server::start(&[
        "-m",
        model.to_str().unwrap(),
        "-np",
        "2",
        "--reasoning-format",
        "deepseek",
    ]);
    let rendered = "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n<think>\n";
    let raw = s
        .post(
            "/v1/completions",
            &json!({"prompt": rendered, "max_tokens": 16, "temperature": 0}),
        )
        .json();
    let raw = raw["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(
        !raw.contains("</think>"),
        "the tiny model does not close thinking blocks: {raw:?}"
    );

    let r = s
        .post(
            "/v1/chat/completions",
            &chat("def add(a, b):", json!({"max_tokens": 16})),
        )
        .json();
    let msg = &r["choices"][0]["message"];
    assert_eq!(msg["reasoning_content"], raw.as_str());
    assert_eq!(msg["content"], "");
    let (status, chunks, done) = s.stream(
        "/v1/chat/completions",
        &chat("def add(a, b):", json!({"max_tokens": 16, "stream": true})),
    );
    assert_eq!(status, 200);
    assert!(done);
    assert_eq!(stream_text(&chunks, "reasoning_content"), raw);
    assert_eq!(stream_text(&chunks, "content"), "");

    // With thinking off the template closes the block itself: everything is content.
    let off = s
        .post(
            "/v1/chat/completions",
            &chat(
                "def add(a, b):",
                json!({"max_tokens": 16, "chat_template_kwargs": {"enable_thinking": false}}),
            ),
        )
        .json();
    assert!(off["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());
    assert!(!off["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
}

/// A reasoning budget (`thinking_budget_tokens`, the server's `--reasoning-budget`) lets the
/// block take that many of the model's own tokens, writes `--reasoning-budget-message` and the
/// closing tag, and the answer follows as content; drafting on, streamed or not, and the same
/// text as the plain model's first tokens.
#[test]
fn a_reasoning_budget_closes_the_block_and_the_answer_follows() {
    let model = thinking_model();
    let s = Server::start(&[
        "-m",
        model.to_str().unwrap(),
        "-np",
        "2",
        "--spec-type",
        "nextn",
        "--reasoning-format",
        "deepseek",
        "--reasoning-budget",
        "6",
        "--reasoning-budget-message",
        " Enough.",
    ]);
    let rendered = "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n<think>\n";
    let first = |n: usize| -> String {
        let r = s
            .post(
                "/v1/completions",
                &json!({"prompt": rendered, "max_tokens": n, "temperature": 0, "thinking_budget_tokens": -1}),
            )
            .json();
        r["choices"][0]["text"].as_str().unwrap().to_string()
    };
    for (budget, extra) in [(10, json!({"thinking_budget_tokens": 10})), (6, json!({}))] {
        let mut body = chat("def add(a, b):", json!({"max_tokens": 48}));
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = s.post("/v1/chat/completions", &body).json();
        let msg = &r["choices"][0]["message"];
        let reasoning = msg["reasoning_content"].as_str().unwrap();
        let want = format!("{} Enough.", first(budget));
        assert_eq!(reasoning.trim(), want.trim(), "budget {budget}: {r}");
        let content = msg["content"].as_str().unwrap();
        assert!(
            !content.is_empty(),
            "budget {budget}: no answer after the block: {r}"
        );
        assert!(!content.contains("</think>"), "{r}");
        assert_eq!(r["usage"]["completion_tokens"], 48);
        body["stream"] = json!(true);
        let (status, chunks, done) = s.stream("/v1/chat/completions", &body);
        assert_eq!(status, 200);
        assert!(done);
        assert_eq!(stream_text(&chunks, "reasoning_content"), reasoning);
        assert_eq!(stream_text(&chunks, "content"), content);
    }
    // -1 lifts the server's budget: the tiny model never closes the block itself.
    let r = s
        .post(
            "/v1/chat/completions",
            &chat(
                "def add(a, b):",
                json!({"max_tokens": 48, "thinking_budget_tokens": -1}),
            ),
        )
        .json();
    assert_eq!(r["choices"][0]["message"]["content"], "", "{r}");
    let bad = s.post(
        "/v1/chat/completions",
        &chat("def add(a, b):", json!({"thinking_budget_tokens": -2})),
    );
    assert_eq!(bad.status, 400);
    assert!(
        bad.text().contains("thinking_budget_tokens"),
        "{}",
        bad.text()
    );
}

/// A seed pins the output: the same seeded request, sent again and again while eight other
/// streams keep the server busy and the `auto` policy drafts as load allows, gets the same text
/// every time — the text it gets on an idle server.
#[test]
fn seeded_requests_give_the_same_tokens_under_load() {
    let s = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "9",
        "-c",
        "18432",
        "--spec-max-drafting-slots",
        "auto",
    ]);
    let seeded = chat(
        "def parse(self, text):",
        json!({"max_tokens": 48, "temperature": 0.8, "seed": 7}),
    );
    let answer = |s: &Server| -> String {
        let r = s.post("/v1/chat/completions", &seeded);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["usage"]["completion_tokens"], 48, "{v}");
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let idle = answer(&s);
    let port = s.port;
    let busy: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let c = Server::attach(port);
                let body = chat(
                    &format!("class Shape{i}:"),
                    json!({"max_tokens": 1500, "temperature": 0.7, "seed": i, "stream": true, "ignore_eos": true}),
                );
                let (status, chunks, done) = c.stream("/v1/chat/completions", &body);
                assert_eq!(status, 200);
                assert!(done && !chunks.is_empty());
            })
        })
        .collect();
    let t0 = Instant::now();
    while s.metric("llamacpp:requests_processing") < 8.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the background streams never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for i in 0..5 {
        assert_eq!(answer(&s), idle, "request {i} under load");
        assert!(
            s.metric("llamacpp:requests_processing") >= 8.0,
            "the background streams ended before request {i}"
        );
    }
    for t in busy {
        t.join().unwrap();
    }
}

/// A conversation's next turn resumes from the prefix cache: `cached_tokens` and `cache_n` say
/// how much, the answer is the one a cold server gives, `cache_prompt: false` bypasses the cache,
/// and a `cache_prompt` of the wrong type is a 400 naming it.
#[test]
fn the_next_turn_resumes_from_the_prefix_cache() {
    let warm = Server::start(&["--spec-type", "nextn", "-np", "2", "--api-key", KEY]);
    let cold = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "2",
        "--api-key",
        KEY,
        "--cache-ram",
        "0",
    ]);
    let system = "You write Python. ".repeat(20);
    let turn1 = json!({"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "def parse(line):"}
    ], "temperature": 0, "max_tokens": 24});
    let a1 = post(&warm, "/v1/chat/completions", &turn1).json();
    assert_eq!(a1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = a1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let turn2 = json!({"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "def parse(line):"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now add a docstring."}
    ], "temperature": 0, "max_tokens": 24});
    let w = post(&warm, "/v1/chat/completions", &turn2).json();
    let c = post(&cold, "/v1/chat/completions", &turn2).json();
    let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = w["usage"]["prompt_tokens"].as_u64().unwrap();
    // At least the system prompt and the first user message come from the cache.
    assert!(cached > 100 && cached < prompt, "{cached} of {prompt}");
    assert_eq!(w["timings"]["cache_n"].as_u64(), Some(cached));
    assert_eq!(w["timings"]["prompt_n"].as_u64(), Some(prompt - cached));
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(w["choices"][0]["message"], c["choices"][0]["message"]);

    let mut bypass = turn2.clone();
    bypass["cache_prompt"] = json!(false);
    let b = post(&warm, "/v1/chat/completions", &bypass).json();
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(b["choices"][0]["message"], c["choices"][0]["message"]);

    let mut bad = turn2;
    bad["cache_prompt"] = json!("yes");
    let r = post(&warm, "/v1/chat/completions", &bad);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "cache_prompt");

    let m = get(&warm, "/metrics").text();
    assert!(
        metric(&m, "nextn:prompt_tokens_cached_total") >= cached as f64,
        "{m}"
    );
    assert!(metric(&m, "nextn:cache_snapshots") >= 1.0);
    assert!(metric(&m, "nextn:cache_bytes") > 0.0);
}
