use super::*;

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

fn conv(v: Value) -> Result<Converted, ApiError> {
    convert(&obj(v), false)
}

#[test]
fn a_conversation_with_tools_becomes_a_chat_request() {
    let c = conv(json!({
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
    let chat = &c.chat;
    assert_eq!(chat["max_tokens"], 2000);
    assert_eq!(chat["stop"], json!(["END"]));
    assert_eq!(chat["tool_choice"], "required");
    assert_eq!(chat["parallel_tool_calls"], false);
    assert_eq!(
        chat["chat_template_kwargs"],
        json!({"enable_thinking": true})
    );
    assert_eq!(c.deferred, vec!["later".to_string()]);
    let m = chat["messages"].as_array().unwrap();
    assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
    assert_eq!(
        m[1],
        json!({"role": "user", "content": "Weather in Paris?"})
    );
    assert_eq!(m[2]["reasoning_content"], "Use the tool.");
    assert_eq!(m[2]["content"], "Checking.");
    assert_eq!(
        m[2]["tool_calls"][0]["function"]["arguments"],
        "{\"city\":\"Paris\"}"
    );
    assert_eq!(
        m[3],
        json!({"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"})
    );
    assert_eq!(m[4]["content"], "Error: boom");
    assert_eq!(m[5], json!({"role": "user", "content": "And tomorrow?"}));
    assert_eq!(m.len(), 6);
    // The chat path takes it as it is.
    let req = parse_chat(chat).unwrap();
    assert_eq!(req.tool_choice, crate::tools::ToolChoice::Required);
    assert!(!req.parallel_tool_calls);
    assert_eq!(req.params.n_predict, Some(2000));
    assert_eq!(req.params.sampler.top_k, 5);
    assert_eq!(
        req.messages[2].tool_calls.as_ref().unwrap()[0]["function"]["arguments"],
        json!({"city": "Paris"})
    );
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
            with(
                "tools",
                json!([{"type": "web_search_20250305", "name": "web_search"}]),
            ),
            "tools[0]",
        ),
        (with("tools", json!([{"name": "f"}])), "tools[0]"),
        (
            with(
                "tools",
                json!([{"name": "f", "input_schema": {}, "strict": true}]),
            ),
            "tools[0]",
        ),
        (with("tool_choice", json!({"type": "tool"})), "tool_choice"),
        (
            with("tool_choice", json!({"type": "sometimes"})),
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
        (with("thinking", json!({"type": "sometimes"})), "thinking"),
        (
            with(
                "context_management",
                json!({"edits": [{"type": "clear_tool_uses_20250919"}]}),
            ),
            "context_management",
        ),
        (
            with("output_config", json!({"format": {"type": "json_schema"}})),
            "output_config",
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
    }
    // What Claude Code sends alongside is accepted.
    let mut b = base();
    b["thinking"] = json!({"type": "adaptive", "display": "omitted"});
    b["context_management"] =
        json!({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]});
    b["output_config"] = json!({"effort": "medium"});
    let c = conv(b).unwrap();
    assert!(!c.show_thinking);
    assert_eq!(
        c.chat["chat_template_kwargs"],
        json!({"enable_thinking": true})
    );
    let mut b = base();
    b["thinking"] = json!({"type": "disabled"});
    assert_eq!(
        conv(b).unwrap().chat["chat_template_kwargs"],
        json!({"enable_thinking": false})
    );
    // count_tokens has no max_tokens.
    assert!(convert(
        &obj(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})),
        true
    )
    .is_ok());
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
    let c = conv(json!({"model": "m", "max_tokens": 8,
        "tools": [{"name": "grep", "description": "search", "input_schema": {"type": "object"}, "defer_loading": true}],
        "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_reference", "tool_name": "grep"}]}]}]}))
    .unwrap();
    let content = c.chat["messages"][0]["content"].as_str().unwrap();
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

/// Image blocks of a user message become chat completions' `image_url` parts in order with its
/// text: a base64 source as a data URI, a URL source as its URL.
#[test]
fn image_blocks_become_image_url_parts_in_order() {
    let base =
        || json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let mut b = base();
    b["messages"] = json!([{"role": "user", "content": [
        {"type": "text", "text": "Compare "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
        {"type": "text", "text": "with"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"}},
        {"type": "text", "text": "."},
    ]}]);
    let c = conv(b).unwrap();
    assert_eq!(
        c.chat["messages"][0]["content"],
        json!([
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
            {"type": "text", "text": "with"},
            {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}},
            {"type": "text", "text": "."},
        ])
    );
    // Text alone stays a string.
    assert_eq!(
        conv(base()).unwrap().chat["messages"][0]["content"],
        json!("hi")
    );
}

/// A `url` image source reaches the chat path as an image to fetch, named by its chat field.
#[test]
fn a_url_image_source_is_an_image_to_fetch() {
    let c = conv(
        json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"}},
            {"type": "text", "text": "What is it?"},
        ]}]}),
    )
    .unwrap();
    let req = parse_chat(&c.chat).unwrap();
    assert_eq!(req.images.len(), 1);
    assert_eq!(
        req.images[0].remote_url(),
        Some("https://example.com/b.jpg")
    );
    assert_eq!(req.images[0].field, "messages[0].content[0].image_url.url");
    // Other schemes are refused while parsing, as in chat completions.
    let c = conv(
        json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}},
        ]}]}),
    )
    .unwrap();
    let e = parse_chat(&c.chat).unwrap_err();
    assert!(
        e.message.contains("only http:// and https://"),
        "{}",
        e.message
    );
}
