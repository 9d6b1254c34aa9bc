//! Chat templates vs llama.cpp: the fixtures' GGUF templates rendered like llama-server `--jinja`
//! (/apply-template) and like llama.cpp's built-in ChatML renderer.

use std::path::PathBuf;

use nextn_engine::chat::{ChatMessage, ChatTemplate};
use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use serde_json::{json, Map, Value};

fn load_json(path: &PathBuf) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn messages(request: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(request["messages"].clone()).expect("request messages")
}

fn gguf_template(path: &PathBuf) -> ChatTemplate {
    let file = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ChatTemplate::from_gguf(&file)
        .expect("template compiles")
        .expect("file has a chat template")
}

/// Renders a llama-server request: a trailing assistant message is continued, otherwise the
/// generation prompt is added.
fn render_like_server(template: &ChatTemplate, request: &Value) -> String {
    let msgs = messages(request);
    let kwargs: Map<String, Value> = request["chat_template_kwargs"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    if msgs.last().is_some_and(|m| m.role == "assistant") {
        template
            .render_prefill(&msgs, &kwargs)
            .expect("prefill renders")
    } else {
        template.render(&msgs, true, &kwargs).expect("renders")
    }
}

#[test]
fn qwen_fixture_template_matches_llama_server() {
    let Some(dir) = nextn_testdata::shared("golden/q35-dense-qwenvocab") else {
        return;
    };
    let golden = load_json(&dir.join("golden.json"));
    let template = gguf_template(&dir.join("q35-dense-qwenvocab-F32-embQ8_0.gguf"));
    assert_eq!(
        template.source(),
        golden["chat_template"]["template"]
            .as_str()
            .expect("template text")
    );

    let cases = golden["chat_template"]["jinja_server"]
        .as_object()
        .expect("jinja_server cases");
    assert!(cases.len() >= 5);
    for (name, case) in cases {
        let prompt = render_like_server(&template, &case["request"]);
        assert_eq!(
            prompt,
            case["prompt"].as_str().expect("prompt"),
            "case {name}"
        );
    }
    // The same renderings recorded from the MTP server run.
    let server = golden["server_mtp"]["apply_template"]
        .as_object()
        .expect("apply_template");
    for (name, case) in server {
        assert_eq!(
            render_like_server(&template, &case["request"]),
            case["prompt"].as_str().expect("prompt"),
            "{name}"
        );
    }
}

#[test]
fn builtin_chatml_matches_llama_cpp() {
    let Some(fixtures) = nextn_testdata::shared("golden") else {
        return;
    };
    for fixture in ["q35-dense-qwenvocab", "q35-dense-a", "q35moe-a", "q35moe-b"] {
        let golden = load_json(&fixtures.join(fixture).join("golden.json"));
        let builtin = &golden["chat_template"]["builtin"];
        // The conversation of llama.cpp's built-in renderings (reasoning is not part of ChatML).
        let msgs = [
            ChatMessage::new("system", "You are a helpful assistant."),
            ChatMessage::new("user", "What is GGUF? 你好"),
            ChatMessage::new("assistant", "A file format for model weights."),
        ];
        let chatml = ChatTemplate::chatml();
        let none = Map::new();
        assert_eq!(
            chatml.render(&msgs, false, &none).unwrap(),
            builtin["no_assistant"].as_str().unwrap(),
            "{fixture}"
        );
        assert_eq!(
            chatml.render(&msgs, true, &none).unwrap(),
            builtin["add_assistant"].as_str().unwrap(),
            "{fixture}"
        );
    }
}

#[test]
fn rendered_chat_prompt_tokenizes_like_the_golden_sequence() {
    let Some(dir) = nextn_testdata::shared("golden/q35-dense-qwenvocab") else {
        return;
    };
    let golden = load_json(&dir.join("golden.json"));
    let path = dir.join("q35-dense-qwenvocab-F32-embQ8_0.gguf");
    let file = GgufFile::open(&path).expect("open");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let template = ChatTemplate::from_gguf(&file)
        .expect("compiles")
        .expect("has template");

    let prompt = template
        .render(
            &[ChatMessage::new("user", "Write a haiku about tensors.")],
            true,
            &Map::new(),
        )
        .expect("renders");
    assert_eq!(prompt, "<|im_start|>user\nWrite a haiku about tensors.<|im_end|>\n<|im_start|>assistant\n<think>\n");
    let chat = golden["sequences"]
        .as_array()
        .expect("sequences")
        .iter()
        .find(|s| s["name"] == "chat")
        .expect("chat sequence");
    let expected: Vec<u32> = serde_json::from_value(chat["tokens"].clone()).expect("ids");
    assert_eq!(tokenizer.encode(&prompt, true), expected);
}

#[test]
fn qwen_fixture_template_thinking_switch() {
    let Some(dir) = nextn_testdata::shared("golden/q35-dense-qwenvocab") else {
        return;
    };
    let template = gguf_template(&dir.join("q35-dense-qwenvocab-F32-embQ8_0.gguf"));
    let msgs = [ChatMessage::new("user", "Hi")];
    let off = json!({"enable_thinking": false});
    assert_eq!(
        template
            .render(&msgs, true, off.as_object().unwrap())
            .unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // Without a generation prompt the conversation ends after the last turn.
    assert_eq!(
        template.render(&msgs, false, &Map::new()).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn tiny_model_template_is_chatml() {
    let Some(dir) = nextn_testdata::shared("models/tiny-qwen35-mtp") else {
        return;
    };
    let template = gguf_template(&dir.join("tiny-qwen35-mtp-F32.gguf"));
    let prompt = template
        .render(&[ChatMessage::new("user", "hi")], true, &Map::new())
        .expect("renders");
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}
