use super::*;

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

fn parsed(v: Value) -> ResponsesRequest {
    parse(&obj(v), None).unwrap()
}

#[test]
fn a_string_input_with_instructions_is_a_system_and_a_user_message() {
    let r = parsed(json!({
        "model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 20,
        "temperature": 0.5, "top_p": 0.9, "stream": true, "store": false, "metadata": {"k": "v"},
    }));
    assert_eq!(
        r.chat["messages"],
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    );
    assert_eq!(r.chat["max_tokens"], 20);
    assert_eq!(
        (r.chat["temperature"].clone(), r.chat["top_p"].clone()),
        (json!(0.5), json!(0.9))
    );
    assert!(r.stream && !r.store);
    assert_eq!(r.echo["metadata"], json!({"k": "v"}));
    assert_eq!(r.echo["instructions"], "Be brief.");
    assert_eq!(r.echo["max_output_tokens"], 20);
    assert_eq!(r.conversation.len(), 1);
}

#[test]
fn items_become_one_assistant_turn_per_reasoning_text_and_calls() {
    let r = parsed(json!({
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "close", "namespace": "agents", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": base64::encode(b"again")},
            {"type": "message", "role": "assistant", "content": "Sunny."},
        ],
        "instructions": "sys",
    }));
    assert_eq!(
        r.chat["messages"],
        json!([
            {"role": "system", "content": "sys\n\nrules"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "look it up", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "c2", "type": "function", "function": {"name": "agents.close", "arguments": {}}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "c2", "content": "ok"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "again"},
        ])
    );
}

#[test]
fn a_stored_conversation_comes_first() {
    let previous = vec![
        json!({"type": "message", "role": "user", "content": "one"}),
        json!({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "two", "annotations": []}]}),
    ];
    let r = parse(
        &obj(json!({"input": "three", "previous_response_id": "resp_1"})),
        Some(previous),
    )
    .unwrap();
    let roles: Vec<&str> = r.chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    assert_eq!(r.conversation.len(), 3);
    assert_eq!(r.echo["previous_response_id"], "resp_1");
}

#[test]
fn tools_tool_choice_format_and_effort_map_to_the_chat_request() {
    let r = parsed(json!({
        "input": "x",
        "tools": [
            {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": true},
            {"type": "namespace", "name": "ns", "description": "group", "tools": [
                {"type": "function", "name": "g", "parameters": {"type": "object"}}]},
        ],
        "tool_choice": {"type": "function", "name": "g"},
        "parallel_tool_calls": false,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "integer"}, "strict": true}},
        "reasoning": {"effort": "minimal", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
    }));
    assert_eq!(
        r.chat["tools"],
        json!([
            {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "ns.g", "parameters": {"type": "object"}}},
        ])
    );
    assert_eq!(
        r.chat["tool_choice"],
        json!({"type": "function", "function": {"name": "ns.g"}})
    );
    assert_eq!(r.chat["parallel_tool_calls"], false);
    assert_eq!(
        r.chat["response_format"],
        json!({"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}})
    );
    assert_eq!(
        r.chat["chat_template_kwargs"],
        json!({"enable_thinking": false})
    );
    assert!(r.encrypted_reasoning);
    assert_eq!(
        r.namespaced.get("ns.g"),
        Some(&("ns".to_string(), "g".to_string()))
    );
    assert_eq!(
        r.echo["reasoning"],
        json!({"effort": "minimal", "summary": "auto"})
    );
    let on = parsed(json!({"input": "x", "reasoning": {"effort": "high"}}));
    assert_eq!(
        on.chat["chat_template_kwargs"],
        json!({"enable_thinking": true})
    );
    let default = parsed(json!({"input": "x", "reasoning": {"summary": "auto"}}));
    assert!(default.chat.get("chat_template_kwargs").is_none());
    let json_object = parsed(json!({"input": "x", "text": {"format": {"type": "json_object"}}}));
    assert_eq!(
        json_object.chat["response_format"],
        json!({"type": "json_object"})
    );
    let plain = parsed(json!({"input": "x", "text": {"format": {"type": "text"}}}));
    assert!(plain.chat.get("response_format").is_none());
}

#[test]
fn what_is_not_supported_is_refused_naming_the_field() {
    let cases = [
        (json!({}), "input"),
        (json!({"input": 5}), "input"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}),
            "input[0].content[0].file_id",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:", "detail": "max"}]}]}),
            "input[0].content[0].detail",
        ),
        (
            json!({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:"}]}]}),
            "input[0].content[0]",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}]}),
            "input[0].output[0]",
        ),
        (
            json!({"input": [{"type": "web_search_call", "id": "w"}]}),
            "input[0]",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "w"}]}),
            "input[0]",
        ),
        (
            json!({"input": [{"role": "wizard", "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
            "input[0]",
        ),
        (
            json!({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "not ours!"}]}),
            "input[0].encrypted_content",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0]",
        ),
        (
            json!({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}),
            "tools[0]",
        ),
        (
            json!({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "c"}]}]}),
            "tools[0].tools[0]",
        ),
        (
            json!({"input": "x", "tool_choice": {"type": "web_search_preview"}}),
            "tool_choice",
        ),
        (json!({"input": "x", "tool_choice": "any"}), "tool_choice"),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"input": "x", "max_output_tokens": "many"}),
            "max_output_tokens",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}),
            "text.format",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "xml"}}}),
            "text.format",
        ),
        (
            json!({"input": "x", "text": {"verbosity": "low"}}),
            "text.verbosity",
        ),
        (
            json!({"input": "x", "reasoning": {"effort": "extreme"}}),
            "reasoning.effort",
        ),
        (
            json!({"input": "x", "reasoning": {"summary": "long"}}),
            "reasoning.summary",
        ),
        (
            json!({"input": "x", "include": ["message.output_text.logprobs"]}),
            "include",
        ),
        (json!({"input": "x", "include": ["everything"]}), "include"),
        (json!({"input": "x", "background": true}), "background"),
        (
            json!({"input": "x", "conversation": "conv_1"}),
            "conversation",
        ),
        (json!({"input": "x", "prompt": {"id": "p"}}), "prompt"),
        (json!({"input": "x", "truncation": "auto"}), "truncation"),
        (json!({"input": "x", "top_logprobs": 3}), "top_logprobs"),
        (json!({"input": "x", "max_tool_calls": 2}), "max_tool_calls"),
        (
            json!({"input": "x", "service_tier": "flex"}),
            "service_tier",
        ),
        (json!({"input": "x", "metadata": {"k": 1}}), "metadata"),
        (json!({"input": "x", "store": "yes"}), "store"),
        (
            json!({"input": "x", "previous_response_id": 7}),
            "previous_response_id",
        ),
    ];
    for (body, param) in cases {
        let e = parse(&obj(body.clone()), None).expect_err(&body.to_string());
        assert_eq!(e.status.as_u16(), 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
    }
    // What turns a feature off is accepted.
    let ok = json!({"input": "x", "truncation": "disabled", "background": false, "top_logprobs": 0,
                    "service_tier": "auto", "include": ["file_search_call.results"], "text": {"verbosity": "medium"}});
    assert!(parse(&obj(ok.clone()), None).is_ok(), "{ok}");
}

/// `input_image` parts of a user message become chat completions' `image_url` parts, in order
/// with its text.
#[test]
fn input_images_become_image_url_parts() {
    let r = parse(
        &obj(json!({"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBOR", "detail": "low"},
        ]}]})),
        None,
    )
    .unwrap();
    assert_eq!(
        r.chat["messages"][0]["content"],
        json!([
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR", "detail": "low"}},
        ])
    );
}

/// An `input_image` with an http(s) `image_url` reaches the chat path as an image to fetch.
#[test]
fn an_input_image_url_is_an_image_to_fetch() {
    let r = parsed(json!({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": "http://127.0.0.1:9/a.png"},
    ]}]}));
    let req = crate::request::parse_chat(&r.chat).unwrap();
    assert_eq!(req.images.len(), 1);
    assert_eq!(req.images[0].remote_url(), Some("http://127.0.0.1:9/a.png"));
    assert_eq!(req.images[0].field, "messages[0].content[1].image_url.url");
}
