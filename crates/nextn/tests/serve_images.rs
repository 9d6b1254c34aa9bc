//! `nextn serve --mmproj` with a random-weight mmproj written for the bundled model: images in
//! chat completions through the official `openai` client (tools/openai_image_check.py), and a
//! server without a vision tower refusing them with a 400 that says so.

mod serve_common;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;

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
