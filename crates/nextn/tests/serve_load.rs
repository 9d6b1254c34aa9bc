//! Sixteen streaming clients at once on sixteen slots: every response complete and correct,
//! the same prompt gives the same text on every slot and alone, and the metrics add up to what
//! the clients received.

mod serve_common;

use serde_json::{json, Value};
use serve_common::{chat, metric, stream_text, Server};

const SAME: &str = "class Stack:\n    def __init__(self):";

struct Outcome {
    text: String,
    slot: u64,
    finish: String,
    prompt_tokens: u64,
    completion_tokens: u64,
    draft_n: u64,
    draft_n_accepted: u64,
}

fn run(s: &Server, body: &Value) -> Outcome {
    let (status, chunks, done) = s.stream("/v1/chat/completions", body);
    assert_eq!(status, 200);
    assert!(done, "stream ended without [DONE]");
    let finish = chunks
        .iter()
        .rev()
        .find(|c| {
            c["choices"]
                .get(0)
                .is_some_and(|ch| !ch["finish_reason"].is_null())
        })
        .expect("a finish chunk");
    let usage = &chunks.last().expect("chunks")["usage"];
    Outcome {
        text: stream_text(&chunks, "content"),
        slot: finish["id_slot"].as_u64().unwrap(),
        finish: finish["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap(),
        completion_tokens: usage["completion_tokens"].as_u64().unwrap(),
        draft_n: finish["timings"]["draft_n"].as_u64().unwrap(),
        draft_n_accepted: finish["timings"]["draft_n_accepted"].as_u64().unwrap(),
    }
}

#[test]
fn sixteen_parallel_streams() {
    // Small prompt chunks per step: prompts are processed while other slots decode.
    let s = Server::start(&[
        "--spec-type",
        "nextn",
        "-np",
        "16",
        "-c",
        "8192",
        "-b",
        "32",
        "--log-disable",
    ]);
    let body = |i: usize| -> Value {
        let opts =
            json!({"max_tokens": 48, "stream": true, "stream_options": {"include_usage": true}});
        if i & 1 == 0 {
            chat(SAME, opts)
        } else {
            chat(
                &format!("# helper {i}\n{}def f{i}(x):", "import os\n".repeat(i)),
                json!({"max_tokens": 20 + i, "stream": true, "stream_options": {"include_usage": true}}),
            )
        }
    };
    let alone = run(&s, &body(0));
    assert_eq!(alone.completion_tokens, 48);

    let port = s.port;
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let b = body(i);
            std::thread::spawn(move || {
                // Each thread talks to the server through its own connection.
                let s = Server::attach(port);
                run(&s, &b)
            })
        })
        .collect();
    let results: Vec<Outcome> = handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect();

    let mut slots_with_same = Vec::new();
    for (i, r) in results.iter().enumerate() {
        if i & 1 == 0 {
            assert_eq!(
                r.text, alone.text,
                "request {i} on slot {} differs from the same prompt alone",
                r.slot
            );
            assert_eq!(r.completion_tokens, 48);
            slots_with_same.push(r.slot);
        } else {
            assert_eq!(r.completion_tokens, 20 + i as u64, "request {i}");
            assert_eq!(r.finish, "length");
            assert!(!r.text.is_empty());
        }
    }
    slots_with_same.sort_unstable();
    slots_with_same.dedup();
    assert!(
        slots_with_same.len() >= 2,
        "the same prompt ran on several slots: {slots_with_same:?}"
    );

    let m = s.metrics();
    let all = results.iter().chain(std::iter::once(&alone));
    let (mut prompt, mut completion, mut drafted, mut accepted) = (0, 0, 0, 0);
    for r in all {
        prompt += r.prompt_tokens;
        completion += r.completion_tokens;
        drafted += r.draft_n;
        accepted += r.draft_n_accepted;
    }
    // Processed prompt tokens (as llama-server counts them) plus those resumed from the cache.
    assert_eq!(
        metric(&m, "llamacpp:prompt_tokens_total") + metric(&m, "nextn:prompt_tokens_cached_total"),
        prompt as f64
    );
    assert_eq!(
        metric(&m, "llamacpp:tokens_predicted_total"),
        completion as f64
    );
    assert_eq!(
        metric(&m, "llamacpp:spec_decode_num_draft_tokens_total"),
        drafted as f64
    );
    assert_eq!(
        metric(&m, "llamacpp:spec_decode_num_accepted_tokens_total"),
        accepted as f64
    );
    assert_eq!(metric(&m, "nextn:requests_finished_total"), 17.0);
    assert_eq!(metric(&m, "llamacpp:requests_processing"), 0.0);
    assert_eq!(metric(&m, "llamacpp:requests_deferred"), 0.0);
}

/// `serve --force-acceptance`: a request that sends its plain output runs the loop at the
/// server's rates (each draft position kept in its share of steps, seeded per request) and still
/// answers exactly the plain output; a server without the flag refuses the field.
#[test]
fn forced_acceptance_through_the_server() {
    let s = Server::start(&[
        "--spec-type",
        "nextn",
        "--force-acceptance",
        "0.9,0.6",
        "--spec-draft-n-max",
        "2",
        "--spec-max-drafting-slots",
        "2",
        "-np",
        "2",
    ]);
    let plain = json!({
        "prompt": "def parse(line):", "max_tokens": 400, "temperature": 0,
        "ignore_eos": true, "return_tokens": true
    });
    let r = s.post("/v1/completions", &plain);
    assert_eq!(r.status, 200, "{}", r.text());
    let reference = r.json()["choices"][0]["tokens"].clone();
    let text = r.json()["choices"][0]["text"].clone();
    assert_eq!(reference.as_array().map(Vec::len), Some(400));

    let before = s.metrics();
    let mut forced = plain.clone();
    forced["forced_acceptance_reference"] = reference.clone();
    forced["seed"] = json!(11);
    let r = s.post("/v1/completions", &forced);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["tokens"], reference, "not the plain output");
    assert_eq!(v["choices"][0]["text"], text);
    let after = s.metrics();
    let delta = |name: &str| metric(&after, name) - metric(&before, name);
    let steps = delta("llamacpp:spec_decode_num_drafts_total");
    assert!(steps >= 150.0, "only {steps} drafting steps");
    for (pos, rate) in [(0, 0.9), (1, 0.6)] {
        let kept = delta(&format!(
            "llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position=\"{pos}\"}}"
        ));
        assert!(
            (kept / steps - rate).abs() < 0.08,
            "position {pos}: {kept} of {steps} kept, asked {rate}"
        );
    }

    let other = Server::start(&[]);
    let r = other.post("/v1/completions", &forced);
    assert_eq!(r.status, 400);
    assert!(r.text().contains("--force-acceptance"), "{}", r.text());
}
