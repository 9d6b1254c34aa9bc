use serde_json::{json, Map, Value};

use super::answer::{tool_use_id, Signature};
use super::request::{normalize_billing_header, parse_messages, Context};
use super::*;
use crate::request::ChatRequest;
use nextn_engine::media::IMAGE_PLACEHOLDER;

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

fn cx(vision: bool) -> Context<'static> {
    Context {
        defaults: None,
        count_only: false,
        vision,
    }
}

fn conv(v: Value) -> Result<(ChatRequest, MessagesAnswer), ApiError> {
    parse_messages(&obj(v), cx(true))
}

/// A tiny PNG, base64: what an image block carries.
const PNG_B64: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg==";

#[test]
fn a_conversation_with_tools_becomes_a_chat_request() {
    let (req, answer) = conv(json!({
        "model": "claude-x", "max_tokens": 2000, "stop_sequences": ["END"], "temperature": 0.5,
        "top_k": 5, "top_p": 0.9, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
                  {"name": "later", "input_schema": {"type": "object"}, "defer_loading": true}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": true},
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}
        ]
    }))
    .unwrap();
    assert_eq!(answer.model, "claude-x");
    assert_eq!(answer.stop_sequences, vec!["END".to_string()]);
    assert!(answer.show_thinking);
    assert_eq!(req.params.n_predict, Some(2000));
    assert_eq!(req.params.stop, vec!["END".to_string()]);
    assert_eq!(req.params.sampler.top_k, 5);
    assert_eq!(req.params.reasoning_budget, Some(Some(1024)));
    assert_eq!(req.tool_choice, crate::tools::ToolChoice::Required);
    assert!(!req.parallel_tool_calls);
    assert_eq!(req.template_kwargs, obj(json!({"enable_thinking": true})));
    // The deferred tool's calls are parsed; the prompt does not show it.
    assert_eq!(req.tools.len(), 2);
    assert_eq!(req.tools_for_template.as_array().unwrap().len(), 1);
    let m = &req.messages;
    assert_eq!(
        (m[0].role.as_str(), m[0].content.as_str()),
        ("system", "Be brief.")
    );
    assert_eq!(
        (m[1].role.as_str(), m[1].content.as_str()),
        ("user", "Weather in Paris?")
    );
    assert_eq!(m[2].reasoning_content.as_deref(), Some("Use the tool."));
    assert_eq!(m[2].content, "Checking.");
    assert_eq!(
        m[2].tool_calls.as_ref().unwrap()[0]["function"]["arguments"],
        json!({"city": "Paris"})
    );
    assert_eq!(
        (m[3].role.as_str(), m[3].content.as_str()),
        ("tool", "21 C")
    );
    assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
    assert_eq!(m[4].content, "Error: boom");
    assert_eq!(
        (m[5].role.as_str(), m[5].content.as_str()),
        ("user", "And tomorrow?")
    );
    assert_eq!(m.len(), 6);
}

#[test]
fn wrong_fields_name_themselves() {
    let base =
        || json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let with = |k: &str, v: Value| {
        let mut b = base();
        b[k] = v;
        b
    };
    let cases = [
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            "max_tokens",
        ),
        (with("max_tokens", json!(0)), "max_tokens"),
        (
            json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
            "model",
        ),
        (with("messages", json!([])), "messages"),
        (
            with("messages", json!([{"role": "tool", "content": "x"}])),
            "messages[0].role",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
            ),
            "messages[0].content[0].source.type",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]),
            ),
            "messages[0].content[0].source.type",
        ),
        // The second block of the first message is named as the client wrote it.
        (
            with(
                "messages",
                json!([{"role": "user", "content": [
                    {"type": "text", "text": "see"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}]}]),
            ),
            "messages[0].content[1].source.data",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]}]),
            ),
            "messages[0].content[0].source.url",
        ),
        (
            with(
                "messages",
                json!([{"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}]),
            ),
            "messages[0].content[0]",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}]}]),
            ),
            "messages[0].content[0].content[0]",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [{"type": "video"}]}]}]),
            ),
            "messages[0].content[0].content[0]",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
            ),
            "messages[0].content[0]",
        ),
        (
            with(
                "messages",
                json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]),
            ),
            "messages[0].content[0]",
        ),
        (with("system", json!(5)), "system"),
        (with("temperature", json!(1.5)), "temperature"),
        (with("stop_sequences", json!("END")), "stop_sequences"),
        (
            with("tools", json!([{"name": "f"}])),
            "tools[0].input_schema",
        ),
        (
            with("tools", json!([{"input_schema": {"type": "object"}}])),
            "tools[0].name",
        ),
        (
            with(
                "tools",
                json!([{"name": "f", "input_schema": {}, "strict": true}]),
            ),
            "tools[0].strict",
        ),
        (
            with(
                "tools",
                json!([{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]),
            ),
            "tools",
        ),
        (
            with("tool_choice", json!({"type": "tool"})),
            "tool_choice.name",
        ),
        (
            with("tool_choice", json!({"type": "sometimes"})),
            "tool_choice.type",
        ),
        (
            with("tool_choice", json!({"type": "tool", "name": "nope"})),
            "tool_choice",
        ),
        (
            with("thinking", json!({"type": "enabled", "budget_tokens": 100})),
            "thinking.budget_tokens",
        ),
        (
            with(
                "thinking",
                json!({"type": "enabled", "budget_tokens": 2048}),
            ),
            "thinking.budget_tokens",
        ),
        (
            with("thinking", json!({"type": "sometimes"})),
            "thinking.type",
        ),
        (
            with("thinking", json!({"type": "adaptive", "display": 3})),
            "thinking.display",
        ),
        (
            with(
                "context_management",
                json!({"edits": [{"type": "clear_tool_uses_20250919"}]}),
            ),
            "context_management",
        ),
        (
            with("output_config", json!({"format": {"type": "json_schema"}})),
            "output_config.format",
        ),
        (
            with("output_config", json!({"effort": "extreme"})),
            "output_config.effort",
        ),
        (with("mcp_servers", json!([{}])), "mcp_servers"),
        (with("metadata", json!({"user_id": 5})), "metadata.user_id"),
    ];
    for (body, param) in cases {
        let e = conv(body.clone()).expect_err(&body.to_string());
        assert_eq!(e.status.as_u16(), 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        // No error speaks of a chat completions field the client never sent.
        assert!(!e.message.contains("image_url"), "{body}: {}", e.message);
    }
    // What Claude Code sends alongside is accepted.
    let mut b = base();
    b["thinking"] = json!({"type": "adaptive", "display": "omitted"});
    b["context_management"] =
        json!({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]});
    b["output_config"] = json!({"effort": "medium"});
    let (req, answer) = conv(b).unwrap();
    assert!(!answer.show_thinking);
    assert_eq!(req.template_kwargs, obj(json!({"enable_thinking": true})));
    // With effort "medium", thinking gets its share of max_tokens.
    assert!(req.params.reasoning_budget.is_some());
    // `thinking.display` values this server does not produce (Claude Code's stream-json
    // `updates`) are read as showing the thinking.
    for display in ["updates", "summarized", "full"] {
        let mut b = base();
        b["thinking"] = json!({"type": "adaptive", "display": display});
        assert!(conv(b).unwrap().1.show_thinking, "{display}");
    }
    let mut b = base();
    b["thinking"] = json!({"type": "disabled"});
    assert_eq!(
        conv(b).unwrap().0.template_kwargs,
        obj(json!({"enable_thinking": false}))
    );
    // count_tokens has no max_tokens.
    let count = Context {
        count_only: true,
        ..cx(true)
    };
    assert!(parse_messages(
        &obj(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})),
        count
    )
    .is_ok());
}

/// Server tools run on Anthropic's side: the request goes on with its client tools.
#[test]
fn server_tools_are_left_out() {
    let (req, _) = conv(json!({"model": "m", "max_tokens": 8,
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                  {"name": "grep", "input_schema": {"type": "object"}},
                  {"type": "code_execution_20250825", "name": "code_execution"}],
        "messages": [{"role": "user", "content": "hi"}]}))
    .unwrap();
    assert_eq!(req.tools.len(), 1);
    assert_eq!(req.tools[0].name, "grep");
    assert_eq!(req.tools_for_template.as_array().unwrap().len(), 1);
}

#[test]
fn the_billing_stamp_does_not_change_the_prompt() {
    let a =
        normalize_billing_header("x-anthropic-billing-header: cc_version=2.1; cch=a5145;You are");
    let b =
        normalize_billing_header("x-anthropic-billing-header: cc_version=2.1; cch=ffe01;You are");
    assert_eq!(a, b);
    assert_eq!(
        a,
        "x-anthropic-billing-header: cc_version=2.1; cch=00000;You are"
    );
    assert_eq!(normalize_billing_header("plain cch=1;"), "plain cch=1;");
}

#[test]
fn tool_references_show_the_tool() {
    let (req, _) = conv(json!({"model": "m", "max_tokens": 8,
        "tools": [{"name": "grep", "description": "search", "input_schema": {"type": "object"}, "defer_loading": true}],
        "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_reference", "tool_name": "grep"}]}]}]}))
    .unwrap();
    let content = &req.messages[0].content;
    assert!(
        content.contains("\"name\":\"grep\"") && content.contains("search"),
        "{content}"
    );
    assert!(conv(json!({"model": "m", "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_reference", "tool_name": "nope"}]}]}]})).is_err());
}

#[test]
fn errors_take_anthropics_shape_and_status() {
    let cases = [
        (ApiError::bad_request("x"), 400, "invalid_request_error"),
        (ApiError::unauthorized(), 401, "authentication_error"),
        (ApiError::not_found("x"), 404, "not_found_error"),
        (ApiError::unavailable("busy"), 529, "overloaded_error"),
        (ApiError::internal("x"), 500, "api_error"),
    ];
    for (e, status, kind) in cases {
        let b = error_body(&e);
        assert_eq!(b["type"], "error");
        assert_eq!(b["error"]["type"], kind);
        assert_eq!(b["error"]["message"], e.message);
        assert_eq!(error_response(e).status().as_u16(), status);
    }
    assert!(is_messages_path("/v1/messages") && is_messages_path("/v1/messages/count_tokens"));
    assert!(!is_messages_path("/v1/messagesx") && !is_messages_path("/v1/chat/completions"));
}

#[test]
fn ids_and_signatures() {
    assert_eq!(tool_use_id("call_00ab"), "toolu_00ab");
    let mut a = Signature::new();
    a.add("think");
    let mut b = Signature::new();
    b.add("thi");
    b.add("nk");
    assert_eq!(a.text(), b.text());
    let mut c = Signature::new();
    c.add("other");
    assert_ne!(a.text(), c.text());
}

/// Image blocks of a user message stand in its text where they were, in order: a base64 source
/// as its bytes, a URL source as an image to fetch, each named by its own field.
#[test]
fn image_blocks_become_images_in_order() {
    let (req, _) = conv(json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}},
        {"type": "text", "text": "with"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"}},
        {"type": "text", "text": "."},
    ]}]}))
    .unwrap();
    assert_eq!(
        req.messages[0].content,
        format!("Compare {IMAGE_PLACEHOLDER}with{IMAGE_PLACEHOLDER}.")
    );
    assert_eq!(req.images.len(), 2);
    assert!(req.images[0].bytes().unwrap().starts_with(b"\x89PNG"));
    assert_eq!(req.images[0].field, "messages[0].content[1].source.data");
    assert_eq!(
        req.images[1].remote_url(),
        Some("https://example.com/b.jpg")
    );
    assert_eq!(req.images[1].field, "messages[0].content[3].source.url");
}

/// A picture a tool returned (Claude Code's Read tool on an image) reaches the model with a
/// vision tower, and is named in the text without one; a text document is read.
#[test]
fn images_and_documents_in_tool_results_are_accepted() {
    let body = json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "Here:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}},
            {"type": "document", "title": "notes", "source": {"type": "text", "media_type": "text/plain", "data": "plain words"}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
        ]}]},
        {"role": "user", "content": "what is in it?"}]});
    let (req, _) = conv(body.clone()).unwrap();
    let tool = &req.messages[1];
    assert_eq!(tool.role, "tool");
    assert!(
        tool.content
            .starts_with(&format!("Here:{IMAGE_PLACEHOLDER}notes\n\nplain words")),
        "{}",
        tool.content
    );
    assert!(
        tool.content.contains("text documents only"),
        "{}",
        tool.content
    );
    assert_eq!(req.images.len(), 1);
    assert_eq!(
        req.images[0].field,
        "messages[1].content[0].content[1].source.data"
    );
    let (req, _) = parse_messages(&obj(body), cx(false)).unwrap();
    assert!(req.images.is_empty());
    assert!(!req.messages[1].content.contains(IMAGE_PLACEHOLDER));
    assert!(
        req.messages[1].content.contains("reads no images"),
        "{}",
        req.messages[1].content
    );
}
