//! A short soak: 16 clients for 60 seconds against one drafting server with four slots. Chat and
//! completions, streamed and not, greedy and seeded, on fresh and on kept-alive connections; one
//! request in ten is a stream the client drops after a few events.
//!
//! Every other request gets 200 and a well-formed answer (streams end with `[DONE]`) equal to
//! the same request's answer alone, sent before the soak; the server's counters move by exactly
//! what the clients counted; its resident memory at the end is within 64 MiB of what it was after
//! the warm-up. `tools/soak.sh` runs the same test for ten minutes; `NEXTN_SOAK_SECS`,
//! `NEXTN_SOAK_CLIENTS` and `NEXTN_SOAK_MODEL` change the duration, the clients and the model.

mod serve_common;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::{metric, stream_text, KeepAlive, Response, Server};

/// Allowed growth of the server's resident memory from the end of the warm-up to the end of the
/// soak. The prefix cache may still fill its 16 MiB budget after the warm-up, slots may reach
/// longer contexts than they had by then, and the allocator keeps freed pages of its per-thread
/// arenas; a leak of a few KiB per request passes this over one minute and fails over ten.
const RSS_GROWTH_MIB: u64 = 64;

fn env_or(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?}: expected a number ({e})")),
        Err(_) => default,
    }
}

/// SplitMix64: each client's own reproducible choices.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

/// What an answer carried.
#[derive(Clone, Debug, PartialEq)]
struct Answer {
    content: String,
    reasoning: String,
    finish: String,
    prompt_tokens: u64,
    completion_tokens: u64,
}

/// One request of the mix and its answer alone.
struct Case {
    path: &'static str,
    body: Value,
    solo: Option<Answer>,
}

impl Case {
    fn body(&self, stream: bool) -> Vec<u8> {
        let mut b = self.body.clone();
        b["stream"] = json!(stream);
        if stream {
            b["stream_options"] = json!({"include_usage": true});
        }
        b.to_string().into_bytes()
    }

    fn chat(&self) -> bool {
        self.path == "/v1/chat/completions"
    }
}

fn cases() -> Vec<Case> {
    let prompts = [
        "def fibonacci(n):".to_string(),
        "The capital of France is".to_string(),
        "class Stack:\n    def __init__(self):".to_string(),
        format!(
            "# notes\n{}\ndef summarize(text):",
            "import os\n".repeat(40)
        ),
        "Write a haiku about the sea.".to_string(),
        "SELECT name FROM users WHERE".to_string(),
    ];
    let mut cases = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        for chat in [true, false] {
            let k = cases.len();
            let mut body = if chat {
                json!({"messages": [{"role": "user", "content": p}]})
            } else {
                json!({"prompt": p})
            };
            body["max_tokens"] = json!(12 + (k * 7) % 28);
            if (i + k) % 2 == 0 {
                body["temperature"] = json!(0);
            } else {
                body["temperature"] = json!(0.8);
                body["seed"] = json!(1000 + k);
            }
            cases.push(Case {
                path: if chat {
                    "/v1/chat/completions"
                } else {
                    "/v1/completions"
                },
                body,
                solo: None,
            });
        }
    }
    cases
}

/// The `data:` payloads of an SSE body, and whether it ended with `[DONE]` (nothing after it).
fn sse_events(text: &str) -> Result<(Vec<Value>, bool), String> {
    let mut chunks = Vec::new();
    let mut done = false;
    for ev in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = ev
            .strip_prefix("data: ")
            .ok_or_else(|| format!("not an SSE data event: {ev:?}"))?;
        if done {
            return Err(format!("data after [DONE]: {data}"));
        }
        if data == "[DONE]" {
            done = true;
        } else {
            chunks.push(
                serde_json::from_str(data)
                    .map_err(|e| format!("chunk {data:?} is not JSON: {e}"))?,
            );
        }
    }
    Ok((chunks, done))
}

/// The answer in a response, or what is wrong with it.
fn answer(case: &Case, stream: bool, r: &Response) -> Result<Answer, String> {
    if r.status != 200 {
        return Err(format!("status {}: {}", r.status, r.text()));
    }
    let u64_of = |v: &Value| v.as_u64().ok_or_else(|| format!("not a count: {v}"));
    if !stream {
        let v: Value = serde_json::from_slice(&r.body)
            .map_err(|e| format!("body is not JSON ({e}): {}", r.text()))?;
        let choice = &v["choices"][0];
        let (content, reasoning) = if case.chat() {
            let m = &choice["message"];
            (
                m["content"].as_str().unwrap_or_default().to_string(),
                m["reasoning_content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        } else {
            (
                choice["text"].as_str().ok_or("no text")?.to_string(),
                String::new(),
            )
        };
        return Ok(Answer {
            content,
            reasoning,
            finish: choice["finish_reason"]
                .as_str()
                .ok_or("no finish_reason")?
                .to_string(),
            prompt_tokens: u64_of(&v["usage"]["prompt_tokens"])?,
            completion_tokens: u64_of(&v["usage"]["completion_tokens"])?,
        });
    }
    if r.header("content-type") != Some("text/event-stream") {
        return Err(format!(
            "stream content type {:?}",
            r.header("content-type")
        ));
    }
    let (chunks, done) = sse_events(&r.text())?;
    if !done {
        return Err(format!("stream ended without [DONE]: {}", r.text()));
    }
    let finish = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .find_map(|ch| ch["finish_reason"].as_str())
        .ok_or("no finish chunk")?
        .to_string();
    let usage = &chunks.last().ok_or("no chunks")?["usage"];
    Ok(Answer {
        content: stream_text(&chunks, "content"),
        reasoning: stream_text(&chunks, "reasoning_content"),
        finish,
        prompt_tokens: u64_of(&usage["prompt_tokens"])?,
        completion_tokens: u64_of(&usage["completion_tokens"])?,
    })
}

const JSON: [(&str, &str); 1] = [("Content-Type", "application/json")];

/// What one client counted.
#[derive(Default, Debug)]
struct Tally {
    completed: u64,
    streamed: u64,
    dropped: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
    /// Most tokens the dropped streams may have generated.
    dropped_budget: u64,
    errors: Vec<String>,
}

const DROPPED_MAX_TOKENS: u64 = 1000;

fn client(id: usize, port: u16, cases: &[Case], until: Instant) -> Tally {
    let mut rng = Rng(0x5eed_0000 + id as u64);
    let mut t = Tally::default();
    // Half the clients keep one connection for all their requests, as SDKs do.
    let mut kept = (id & 1 == 0).then(|| KeepAlive::open(port));
    let server = Server::attach(port);
    while Instant::now() < until && t.errors.len() < 5 {
        let case = &cases[rng.below(cases.len())];
        let solo = case.solo.as_ref().expect("solo answers first");
        if rng.below(10) == 0 {
            // A stream dropped after a few events, while most of its tokens are still to come.
            let mut b = case.body.clone();
            b["stream"] = json!(true);
            b["max_tokens"] = json!(DROPPED_MAX_TOKENS);
            b["ignore_eos"] = json!(true);
            let (status, mut r) = server.open_stream(case.path, &b);
            let mut events = 0;
            while events < 3 && r.next_event().is_some() {
                events += 1;
            }
            if status != 200 || events < 3 {
                t.errors
                    .push(format!("dropped stream: status {status}, {events} events"));
            }
            drop(r);
            t.dropped += 1;
            t.dropped_budget += DROPPED_MAX_TOKENS;
            t.prompt_tokens += solo.prompt_tokens;
            continue;
        }
        let stream = rng.below(2) == 0;
        let body = case.body(stream);
        let r = match kept.as_mut() {
            Some(k) => match k.send("POST", case.path, &JSON, &body) {
                Ok(r) => r,
                Err(e) => {
                    t.errors
                        .push(format!("the kept-alive connection failed: {e}"));
                    kept = Some(KeepAlive::open(port));
                    continue;
                }
            },
            None => server.request("POST", case.path, &JSON, &body),
        };
        match answer(case, stream, &r) {
            Ok(a) if a == *solo => {
                t.completed += 1;
                t.streamed += u64::from(stream);
                t.prompt_tokens += a.prompt_tokens;
                t.completion_tokens += a.completion_tokens;
            }
            Ok(a) => t.errors.push(format!(
                "{} {} (stream {stream}): {a:?}, alone it was {solo:?}",
                case.path, case.body
            )),
            Err(e) => t.errors.push(format!(
                "{} {} (stream {stream}): {e}",
                case.path, case.body
            )),
        }
    }
    t
}

fn rss_mib(s: &Server) -> f64 {
    let pid = s.child.as_ref().expect("a started server").id();
    serve_common::rss_kib(pid).expect("VmRSS in /proc") as f64 / 1024.0
}

#[test]
fn sixty_seconds_of_mixed_clients() {
    let secs = env_or("NEXTN_SOAK_SECS", 60);
    let n_clients = env_or("NEXTN_SOAK_CLIENTS", 16) as usize;
    let model = std::env::var("NEXTN_SOAK_MODEL").ok();
    let mut args = vec![
        "--spec-type",
        "nextn",
        "-np",
        "4",
        "-c",
        "8192",
        "--cache-ram",
        "16",
        "--log-disable",
    ];
    if let Some(m) = &model {
        args.extend(["-m", m.as_str()]);
    }
    let s = Server::start(&args);

    // Every request of the mix alone, first.
    let mut cases = cases();
    for c in &mut cases {
        let stream = false;
        let r = s.request("POST", c.path, &JSON, &c.body(stream));
        let a = answer(c, stream, &r).unwrap_or_else(|e| panic!("{} alone: {e}", c.body));
        assert!(a.completion_tokens > 0);
        c.solo = Some(a);
    }
    let before = s.metrics();

    let t0 = Instant::now();
    let until = t0 + Duration::from_secs(secs);
    let warm_up = Duration::from_secs(secs / 6);
    let (mut baseline, mut peak) = (None, 0.0f64);
    let tallies: Vec<Tally> = std::thread::scope(|scope| {
        let cases = &cases;
        let port = s.port;
        let clients: Vec<_> = (0..n_clients)
            .map(|id| scope.spawn(move || client(id, port, cases, until)))
            .collect();
        // Meanwhile: the server's memory, and other requests answered.
        while Instant::now() < until {
            std::thread::sleep(Duration::from_secs(1));
            let rss = rss_mib(&s);
            peak = peak.max(rss);
            if baseline.is_none() && t0.elapsed() >= warm_up {
                baseline = Some(rss);
            }
            assert_eq!(s.get("/health").status, 200);
        }
        clients
            .into_iter()
            .map(|c| c.join().expect("a client panicked"))
            .collect()
    });

    // Dropped streams free their slots at the server's next step.
    let t_end = Instant::now();
    while s.metric("llamacpp:requests_processing") > 0.0 {
        assert!(
            t_end.elapsed() < Duration::from_secs(30),
            "requests still running after the clients finished"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = s.metrics();
    let end_rss = rss_mib(&s);

    let errors: Vec<&String> = tallies.iter().flat_map(|t| &t.errors).collect();
    let sum = |f: fn(&Tally) -> u64| tallies.iter().map(f).sum::<u64>();
    let (completed, streamed, dropped) = (
        sum(|t| t.completed),
        sum(|t| t.streamed),
        sum(|t| t.dropped),
    );
    let baseline = baseline.expect("an RSS sample after the warm-up");
    eprintln!(
        "soak: {secs} s, {n_clients} clients: {completed} answers ({streamed} streamed), {dropped} dropped streams, {} completion tokens; server RSS {baseline:.1} MiB after warm-up, {end_rss:.1} MiB at the end, peak {peak:.1} MiB",
        sum(|t| t.completion_tokens)
    );
    assert!(
        errors.is_empty(),
        "{} failed requests, first ones:\n{}",
        errors.len(),
        errors
            .iter()
            .take(10)
            .map(|e| e.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(completed > n_clients as u64 && dropped > 0 && streamed > 0);

    // The server counted what the clients counted.
    let delta = |name: &str| metric(&after, name) - metric(&before, name);
    assert_eq!(delta("nextn:requests_finished_total"), completed as f64);
    assert_eq!(delta("nextn:requests_cancelled_total"), dropped as f64);
    assert_eq!(
        delta("llamacpp:prompt_tokens_total") + delta("nextn:prompt_tokens_cached_total"),
        sum(|t| t.prompt_tokens) as f64,
        "prompt tokens processed and resumed from the cache"
    );
    let predicted = delta("llamacpp:tokens_predicted_total");
    let answered = sum(|t| t.completion_tokens) as f64;
    assert!(
        predicted >= answered + dropped as f64
            && predicted <= answered + sum(|t| t.dropped_budget) as f64,
        "{predicted} tokens generated; {answered} answered and {dropped} streams dropped"
    );
    assert_eq!(metric(&after, "llamacpp:requests_deferred"), 0.0);
    assert!(
        metric(&after, "nextn:http_connections") <= 2.0,
        "connections left open"
    );

    assert!(
        end_rss <= baseline + RSS_GROWTH_MIB as f64,
        "the server's memory grew from {baseline:.1} MiB after the warm-up to {end_rss:.1} MiB"
    );
}
