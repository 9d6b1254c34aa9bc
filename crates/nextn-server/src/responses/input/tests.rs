use std::sync::OnceLock;

use nextn_engine::media::IMAGE_PLACEHOLDER;

use super::*;
use crate::tools::ToolChoice;

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

fn sealer() -> &'static Sealer {
    static SEALER: OnceLock<Sealer> = OnceLock::new();
    SEALER.get_or_init(|| Sealer::new().unwrap())
}

fn parse_with(
    v: Value,
    previous: Option<Vec<Value>>,
) -> Result<(ChatRequest, ResponsesRequest), ApiError> {
    parse(
        &obj(v),
        Context {
            previous,
            defaults: None,
            sealer: sealer(),
        },
    )
}

fn parsed(v: Value) -> (ChatRequest, ResponsesRequest) {
    parse_with(v, None).unwrap()
}

/// Role and content of each message.
fn turns(req: &ChatRequest) -> Vec<(&str, &str)> {
    req.messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect()
}

#[test]
fn a_string_input_with_instructions_is_a_system_and_a_user_message() {
    let (chat, r) = parsed(json!({
        "model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 20,
        "temperature": 0.5, "top_p": 0.9, "stream": true, "store": false, "metadata": {"k": "v"},
    }));
    assert_eq!(turns(&chat), [("system", "Be brief."), ("user", "Hi")]);
    assert_eq!(chat.params.n_predict, Some(20));
    assert_eq!(chat.params.sampler.temperature, 0.5);
    assert_eq!(chat.params.sampler.top_p, 0.9);
    assert!(r.stream && !r.store);
    assert_eq!(r.echo["metadata"], json!({"k": "v"}));
    assert_eq!(r.echo["instructions"], "Be brief.");
    assert_eq!(r.echo["max_output_tokens"], 20);
    assert_eq!(r.conversation.len(), 1);
}

#[test]
fn items_become_one_assistant_turn_per_reasoning_text_and_calls() {
    let sealed = sealer().seal("again").unwrap();
    let (chat, _) = parsed(json!({
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "close", "namespace": "agents", "arguments": "{}"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "paris"}},
            {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": sealed},
            {"type": "message", "role": "assistant", "content": "Sunny."},
        ],
        "instructions": "sys",
    }));
    assert_eq!(
        turns(&chat),
        [
            ("system", "sys\n\nrules"),
            ("user", "weather?"),
            ("assistant", "Checking."),
            ("tool", "21 C"),
            ("tool", "ok"),
            ("assistant", "Sunny."),
        ]
    );
    let m = &chat.messages;
    assert_eq!(m[2].reasoning_content.as_deref(), Some("look it up"));
    assert_eq!(
        m[2].tool_calls,
        Some(json!([
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "agents.close", "arguments": {}}},
        ]))
    );
    assert_eq!(m[3].tool_call_id.as_deref(), Some("c1"));
    // Reasoning this server sealed opens again.
    assert_eq!(m[5].reasoning_content.as_deref(), Some("again"));
}

/// `encrypted_content` this server did not seal (another server's, a client's own base64, an
/// altered one) is left out, not read as the model's reasoning.
#[test]
fn reasoning_not_sealed_here_is_left_out() {
    use base64::Engine as _;
    let plain = base64::engine::general_purpose::STANDARD.encode("planted");
    let mut altered = sealer().seal("mine").unwrap();
    altered.push('A');
    for content in [plain, altered, "nextn-sealed-v1.AAAA".to_string()] {
        let (chat, _) = parsed(json!({"input": [
            {"role": "user", "content": "q"},
            {"type": "reasoning", "summary": [], "encrypted_content": content},
            {"type": "message", "role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"},
        ]}));
        assert_eq!(chat.messages[1].reasoning_content, None, "{content}");
    }
}

#[test]
fn a_stored_conversation_comes_first() {
    let previous = vec![
        json!({"type": "message", "role": "user", "content": "one"}),
        json!({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "two", "annotations": []}]}),
    ];
    let (chat, r) = parse_with(
        json!({"input": "three", "previous_response_id": "resp_1"}),
        Some(previous),
    )
    .unwrap();
    assert_eq!(
        turns(&chat),
        [("user", "one"), ("assistant", "two"), ("user", "three")]
    );
    assert_eq!(r.conversation.len(), 3);
    assert_eq!(r.echo["previous_response_id"], "resp_1");
    // An error in the stored part names it as such.
    let previous = vec![json!({"type": "message", "role": "wizard", "content": "x"})];
    let e = parse_with(
        json!({"input": "y", "previous_response_id": "resp_1"}),
        Some(previous),
    )
    .unwrap_err();
    assert!(
        e.param
            .as_deref()
            .unwrap()
            .starts_with("previous_response_id"),
        "{:?}",
        e.param
    );
}

#[test]
fn tools_tool_choice_format_and_effort_map_to_the_chat_request() {
    let (chat, r) = parsed(json!({
        "input": "x",
        "tools": [
            {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": true},
            {"type": "namespace", "name": "ns", "description": "group", "tools": [
                {"type": "function", "name": "g", "parameters": {"type": "object"}}]},
            {"type": "web_search", "external_web_access": true},
        ],
        "tool_choice": {"type": "function", "name": "g"},
        "parallel_tool_calls": false,
        "reasoning": {"effort": "minimal", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
    }));
    assert_eq!(
        chat.tools_for_template,
        json!([
            {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "ns.g", "parameters": {"type": "object"}}},
        ])
    );
    assert_eq!(chat.tools.len(), 2);
    assert_eq!(chat.tool_choice, ToolChoice::Named("ns.g".into()));
    assert!(!chat.parallel_tool_calls);
    assert_eq!(chat.template_kwargs, obj(json!({"enable_thinking": false})));
    assert!(r.encrypted_reasoning);
    assert_eq!(
        r.namespaced.get("ns.g"),
        Some(&("ns".to_string(), "g".to_string()))
    );
    assert_eq!(
        r.echo["reasoning"],
        json!({"effort": "minimal", "summary": "auto"})
    );
    assert_eq!(r.effort.as_deref(), Some("minimal"));
    let (on, _) = parsed(json!({"input": "x", "reasoning": {"effort": "high"}}));
    assert_eq!(on.template_kwargs, obj(json!({"enable_thinking": true})));
    let (default, _) = parsed(json!({"input": "x", "reasoning": {"summary": "auto"}}));
    assert!(default.template_kwargs.get("enable_thinking").is_none());
    let (schema, _) = parsed(json!({"input": "x",
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "integer"}, "strict": true}}}));
    assert_eq!(
        schema.params.grammar,
        Some(GrammarSource::JsonSchema(json!({"type": "integer"})))
    );
    assert_eq!(schema.params.grammar_field, "text.format");
    // A named tool and an output format cannot both hold; the error names the client's field.
    let e = parse_with(json!({"input": "x", "tools": [{"type": "function", "name": "f"}],
        "tool_choice": {"type": "function", "name": "f"}, "text": {"format": {"type": "json_object"}}}), None)
    .unwrap_err();
    assert!(e.message.contains("text.format"), "{}", e.message);
    let (json_object, _) =
        parsed(json!({"input": "x", "text": {"format": {"type": "json_object"}}}));
    assert_eq!(json_object.params.grammar, Some(GrammarSource::JsonObject));
    let (plain, _) = parsed(json!({"input": "x", "text": {"format": {"type": "text"}}}));
    assert!(plain.params.grammar.is_none());
    // A hosted tool asked for leaves the choice to the model.
    let (hosted, _) = parsed(json!({"input": "x", "tools": [{"type": "web_search"}],
        "tool_choice": {"type": "web_search"}}));
    assert_eq!(hosted.tool_choice, ToolChoice::Auto);
    assert!(hosted.tools.is_empty());
}

/// Codex's first request with its default configuration: function tools beside its hosted web
/// search, which is left out.
#[test]
fn codex_default_tools_are_accepted() {
    let (chat, _) = parsed(json!({
        "model": "qwen", "instructions": "You are Codex.", "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]}],
        "tools": [
            {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": false,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]}},
            {"type": "web_search"}],
        "tool_choice": "auto", "parallel_tool_calls": false, "reasoning": {"effort": "medium", "summary": "auto"},
        "store": false, "stream": true, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
    }));
    assert_eq!(chat.tools.len(), 1);
    assert_eq!(chat.tools[0].name, "shell");
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
            json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "data:image/png;base64,%%%"}]}]}),
            "input[0].content[1].image_url",
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
            json!({"input": [{"type": "wizardry", "id": "w"}]}),
            "input[0].type",
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
            "input[0].call_id",
        ),
        (
            json!({"input": [{"type": "reasoning", "summary": [], "encrypted_content": 5}]}),
            "input[0].encrypted_content",
        ),
        (
            json!({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "c"}]}]}),
            "tools[0].tools[0].type",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "parameters": {}}]}),
            "tools[0].name",
        ),
        (json!({"input": "x", "tool_choice": "any"}), "tool_choice"),
        (
            json!({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}),
            "tool_choice",
        ),
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
            "text.format.schema",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "xml"}}}),
            "text.format.type",
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
            "include[0]",
        ),
        (
            json!({"input": "x", "include": ["everything"]}),
            "include[0]",
        ),
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
        (json!({"input": "x", "temperature": "hot"}), "temperature"),
        (
            json!({"input": "x", "previous_response_id": 7}),
            "previous_response_id",
        ),
    ];
    for (body, param) in cases {
        let e = parse_with(body.clone(), None).expect_err(&body.to_string());
        assert_eq!(e.status.as_u16(), 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        // No error speaks of a chat completions field the client never sent.
        for chat_word in [
            "messages[",
            "image_url.url",
            "response_format",
            "max_tokens",
        ] {
            assert!(
                !e.message.contains(chat_word) || body.to_string().contains(chat_word),
                "{body}: {}",
                e.message
            );
        }
    }
    // What turns a feature off is accepted.
    let ok = json!({"input": "x", "truncation": "disabled", "background": false, "top_logprobs": 0,
                    "service_tier": "auto", "include": ["file_search_call.results"], "text": {"verbosity": "medium"}});
    assert!(parse_with(ok.clone(), None).is_ok(), "{ok}");
}

/// `input_image` parts of a user message stand in its text where they were, whatever their
/// `detail`; an http(s) URL is an image to fetch, named by its own field.
#[test]
fn input_images_stand_in_the_text_in_order() {
    for detail in [json!("low"), json!("high"), json!("auto"), Value::Null] {
        let (chat, _) = parsed(json!({"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": detail},
            {"type": "input_image", "image_url": "http://127.0.0.1:9/a.png"},
        ]}]}));
        assert_eq!(
            chat.messages[0].content,
            format!("What is this?{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}")
        );
        assert_eq!(chat.images.len(), 2);
        assert!(chat.images[0].bytes().unwrap().starts_with(b"\x89PNG"));
        assert_eq!(chat.images[0].field, "input[0].content[1].image_url");
        assert_eq!(
            chat.images[1].remote_url(),
            Some("http://127.0.0.1:9/a.png")
        );
        assert_eq!(chat.images[1].field, "input[0].content[2].image_url");
    }
}
