//! `nextn serve --mmproj` with a random-weight mmproj written for the bundled model: images in
//! chat completions through the official `openai` client (tools/openai_image_check.py), a server
//! without a vision tower refusing them with a 400 that says so, a picture being encoded beside
//! another stream without stalling it, and prompts too long with their pictures refused from the
//! images' headers before anything is decoded.

mod serve_common;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;

use std::time::{Duration, Instant};

use serde_json::json;
use serve_common::Server;

#[test]
fn images_through_the_official_openai_client() {
    if let Some(why) = serve_common::missing_python_modules(&["openai"]) {
        assert!(!nextn_testdata::in_ci(), "required in CI (CI=true): {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let s = serve_common::start_with_mmproj(&["--spec-type", "nextn", "-np", "1", "-c", "1024"]);
    let url = format!("http://127.0.0.1:{}/v1", s.port);
    let out = serve_common::run_python_tool("openai_image_check.py", &["--url", &url]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("all image checks passed"),
        "tools/openai_image_check.py failed ({}):\n{stdout}\n{stderr}\nserver log:\n{}",
        out.status,
        s.log_text()
    );
}

#[test]
fn a_server_without_mmproj_refuses_images() {
    let s = Server::start(&["-np", "1", "-c", "256"]);
    // A 1x1 PNG.
    let png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC";
    let r = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}}
        ]}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let text = r.text();
    assert!(text.contains("--mmproj"), "{text}");
    assert!(text.contains("messages[0].content[1]"), "{text}");
    assert_eq!(s.get("/props").json()["modalities"]["vision"], false);
}

#[test]
fn completion_takes_llama_server_multimodal_data() {
    let s = serve_common::start_with_mmproj(&["-np", "1", "-c", "512"]);
    let png = ramp_png();
    let r = s.post(
        "/completion",
        &json!({"prompt": {"prompt_string": "A picture: <__media__> It shows", "multimodal_data": [png]},
                "n_predict": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["timings"]["images_encoded"], 1, "{v}");
    let r = s.post(
        "/completion",
        &json!({"prompt": {"prompt_string": "no marker", "multimodal_data": [png]}, "n_predict": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains("0 <__media__> markers but 1 images"),
        "{}",
        r.text()
    );
}

/// The ramp picture of nextn-vision's test data, base64.
fn ramp_png() -> String {
    STANDARD.encode(serve_common::ramp_png())
}

/// Anthropic `image` blocks and Responses `input_image` parts go through the same image path as
/// chat completions: the image's rows count in the prompt, the next turn with the same picture
/// resumes after it, and `/props` says the server has vision.
#[test]
fn messages_and_responses_take_images() {
    let s = serve_common::start_with_mmproj(&["-np", "1", "-c", "1024"]);
    assert_eq!(s.get("/props").json()["modalities"]["vision"], true);
    let png = ramp_png();
    let message = |with_image: bool| {
        let mut content = vec![json!({"type": "text", "text": "What is in this picture?"})];
        if with_image {
            content.insert(
                0,
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}),
            );
        }
        json!({"model": "m", "max_tokens": 4, "temperature": 0, "thinking": {"type": "disabled"},
               "messages": [{"role": "user", "content": content}]})
    };
    let count = |body: &serde_json::Value| {
        let r = s.post("/v1/messages/count_tokens", body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["input_tokens"].as_u64().unwrap()
    };
    let (with, without) = (count(&message(true)), count(&message(false)));
    assert!(with > without + 4, "the image's rows: {with} vs {without}");
    let first = s.post("/v1/messages", &message(true));
    assert_eq!(first.status, 200, "{}", first.text());
    let u = &first.json()["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        with
    );
    // The same picture again: the prefix cache resumes past it.
    let again = s.post("/v1/messages", &message(true)).json();
    let cached = again["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(
        cached > with - without,
        "resumed {cached} of {with}: {again}"
    );

    let input = |with_image: bool| {
        let mut content = vec![json!({"type": "input_text", "text": "What is in this picture?"})];
        if with_image {
            content.push(
                json!({"type": "input_image", "image_url": format!("data:image/png;base64,{png}")}),
            );
        }
        json!({"model": "m", "max_output_tokens": 4, "temperature": 0,
               "input": [{"role": "user", "content": content}]})
    };
    let tokens = |body: &serde_json::Value| {
        let r = s.post("/v1/responses", body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["usage"]["input_tokens"].as_u64().unwrap()
    };
    assert!(tokens(&input(true)) > tokens(&input(false)) + 4);
    // A damaged picture is the request's fault, named by its field.
    let bad = s.post(
        "/v1/messages",
        &json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
    );
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert_eq!(bad.json()["error"]["type"], "invalid_request_error");
    // Named as the Messages request wrote it, not as a chat completions field.
    let text = bad.text();
    assert!(
        text.contains("messages[0].content[0].source.data") && !text.contains("image_url"),
        "{text}"
    );

    // A picture a tool returned (Claude Code's Read tool on an image) reaches the model.
    let tool_turn = |with_image: bool| {
        let mut result = vec![json!({"type": "text", "text": "the file:"})];
        if with_image {
            result.push(json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}));
        }
        json!({"model": "m", "max_tokens": 4, "temperature": 0, "thinking": {"type": "disabled"},
               "tools": [{"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}],
               "messages": [
                   {"role": "user", "content": "Read a.png"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]})
    };
    let (with, without) = (count(&tool_turn(true)), count(&tool_turn(false)));
    assert!(
        with > without + 4,
        "the tool's picture's rows: {with} vs {without}"
    );
    let r = s.post("/v1/messages", &tool_turn(true));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A picture is encoded on the encoder thread while the other slot streams: the stream's gaps
/// between chunks stay far below the encode's time (inside a step, the encode stalled every
/// other stream for all of it). The tower (16 blocks of width 256 on 16-pixel patches) is given
/// the ramp picture scaled to 256 tokens: an encode of one to a few seconds on one thread, while
/// a decode step of the bundled model takes milliseconds and the picture's own rows, a prompt
/// chunk like any other once encoded, a fraction of the encode.
#[test]
fn an_image_being_encoded_does_not_stall_other_streams() {
    let spec = nextn_vision::synth::TowerSpec {
        n_embd: 256,
        n_ff: 1024,
        n_layer: 16,
        n_head: 4,
        patch_size: 16,
        ..nextn_vision::synth::TowerSpec::fixture(256)
    };
    let s = serve_common::start_with_tower(
        &spec,
        &[
            "-np",
            "2",
            "-c",
            "16384",
            "--image-min-tokens",
            "256",
            "--image-max-tokens",
            "256",
        ],
    );
    // The other stream: long enough to outlast the encode, its chunks timed as they arrive.
    let (status, mut reader) = s.open_stream(
        "/v1/completions",
        &json!({"prompt": "def main():\n", "max_tokens": 7000, "temperature": 0,
                "ignore_eos": true, "stream": true}),
    );
    assert_eq!(status, 200);
    let (times_tx, times_rx) = std::sync::mpsc::channel::<Instant>();
    let streamer = std::thread::spawn(move || {
        while let Some(data) = reader.next_event() {
            if data == "[DONE]" || times_tx.send(Instant::now()).is_err() {
                break;
            }
        }
    });
    // The picture once the stream is under way.
    let first = times_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the stream's first chunk");
    let sent = Instant::now();
    let r = s.post(
        "/completion",
        &json!({"prompt": {"prompt_string": "A picture: <__media__> It shows",
                           "multimodal_data": [ramp_png()]},
                "n_predict": 2, "temperature": 0}),
    );
    let answered = Instant::now();
    assert_eq!(r.status, 200, "{}", r.text());
    let timings = &r.json()["timings"];
    assert_eq!(timings["images_encoded"], 1, "{timings}");
    let encode = Duration::from_secs_f64(timings["image_encode_ms"].as_f64().unwrap() / 1e3);
    // Every chunk up to the first one after the answer: the gap the answer falls in counts too.
    let mut times = vec![first];
    loop {
        match times_rx.recv_timeout(Duration::from_secs(30)) {
            Ok(t) => {
                times.push(t);
                if t > answered {
                    break;
                }
            }
            Err(_) => panic!(
                "the stream ended ({} chunks in {:?}) before the picture was answered ({:?} after it was sent): raise its max_tokens",
                times.len(),
                times[times.len() - 1] - first,
                answered - sent
            ),
        }
    }
    drop(times_rx);
    // The gaps of the stream while the picture was in the server.
    let before = times.iter().rposition(|&t| t < sent).unwrap_or(0);
    let window = &times[before..];
    let worst = window
        .windows(2)
        .max_by_key(|w| w[1].duration_since(w[0]))
        .unwrap();
    let max_gap = worst[1].duration_since(worst[0]);
    eprintln!(
        "encode {encode:?}, picture answered in {:?}; the stream sent {} chunks meanwhile, its longest gap {max_gap:?}",
        answered - sent,
        window.len()
    );
    assert!(
        encode > Duration::from_millis(400),
        "the encode ({encode:?}) is too quick to tell a stall from a step"
    );
    assert!(
        max_gap < encode / 2,
        "the stream stalled for {max_gap:?} ({:?} to {:?} after the picture was sent, answered \
         after {:?}) while the picture was encoded in {encode:?}",
        worst[0].saturating_duration_since(sent),
        worst[1].saturating_duration_since(sent),
        answered - sent
    );
    assert!(
        window.len() >= 10,
        "{} chunks during the encode",
        window.len()
    );
    assert_eq!(s.metric("nextn:images_encoded_total"), 1.0);
    drop(s);
    streamer.join().unwrap();
}

/// The prompt's length with its pictures is checked from their headers before any is decoded:
/// a PNG that is a header declaring 4000x3000 pixels (about 4000 tokens for this tower), with no pixel
/// data, is a 400 naming the context, not a decode error; a header over the side limit is a 400
/// naming the limit; both on chat completions and `/completion`.
#[test]
fn too_long_image_prompts_are_refused_from_the_headers() {
    let s = serve_common::start_with_mmproj(&["-np", "1", "-c", "512"]);
    let header_only = |w, h| {
        format!(
            "data:image/png;base64,{}",
            STANDARD.encode(nextn_vision::synth::png_declaring(w, h, 2, 8))
        )
    };
    let chat = |url: String| {
        s.post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is it?"},
                {"type": "image_url", "image_url": {"url": url}}
            ]}], "max_tokens": 2}),
        )
    };
    let r = chat(header_only(4000, 3000));
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], "exceed_context_size_error", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("context") && message.contains("of them for 1 image(s)"),
        "{message}"
    );
    assert_eq!(v["error"]["n_ctx"], 512, "{v}");
    assert!(
        v["error"]["n_prompt_tokens"].as_u64().unwrap() > 4000,
        "{v}"
    );
    let native = s.post(
        "/completion",
        &json!({"prompt": {"prompt_string": "A picture: <__media__>",
                           "multimodal_data": [STANDARD.encode(nextn_vision::synth::png_declaring(4000, 3000, 2, 8))]},
                "n_predict": 2}),
    );
    assert_eq!(native.status, 400, "{}", native.text());
    assert!(
        native.text().contains("exceed_context_size_error"),
        "{}",
        native.text()
    );
    // Within the context, the same header-only file gets as far as decoding, and fails there.
    let r = chat(header_only(64, 48));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("cannot decode image"), "{}", r.text());
    // Over the side limit: refused from the header, naming the field and the limit.
    let r = chat(header_only(20000, 20000));
    assert_eq!(r.status, 400, "{}", r.text());
    let text = r.text();
    assert!(
        text.contains("20000x20000")
            && text.contains("16384")
            && text.contains("messages[0].content[1]"),
        "{text}"
    );
    assert_eq!(s.metric("nextn:images_encoded_total"), 0.0);
}
