use super::*;
use serde_json::json;

fn no_kwargs() -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::new()
}

fn render_with(source: &str, messages: &[ChatMessage], kwargs: serde_json::Value) -> String {
    let kwargs = kwargs.as_object().cloned().unwrap_or_default();
    ChatTemplate::new(source)
        .expect("compiles")
        .render(messages, true, &kwargs)
        .expect("renders")
}

#[test]
fn chatml_builtin() {
    let messages = [
        ChatMessage::new("system", "S"),
        ChatMessage::new("user", "Hi"),
    ];
    let t = ChatTemplate::chatml();
    assert_eq!(
        t.render(&messages, true, &no_kwargs()).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&messages[1..], false, &no_kwargs()).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn python_string_methods() {
    let src = "{{ messages[0].content.split('</think>')[-1].lstrip('\\n') }}|{{ '  x \\n'.rstrip() }}|\
               {{ 'a,b'.split(',') | join('+') }}|{{ '\\nr\\n'.strip('\\n') }}|{{ 'abc'.startswith('ab') }}|\
               {{ 'abc'.endswith('bc') }}|{{ 'a-b'.replace('-', '_') }}|{{ 'Hi'.upper() }}";
    let messages = [ChatMessage::new("assistant", "<think>r</think>\n\nanswer")];
    assert_eq!(
        render_with(src, &messages, json!({})),
        "answer|  x|a+b|r|True|True|a_b|HI"
    );
}

#[test]
fn namespace_loop_vars_and_reverse_slicing() {
    let src = "{%- set ns = namespace(last_user=-1) -%}\
               {%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}\
               {{ ns.last_user }}|\
               {%- for m in messages[::-1] -%}{{ m.role[0] }}{%- endfor -%}|\
               {%- for m in messages -%}{%- if loop.previtem is defined -%}{{ loop.previtem.role[0] }}>{%- endif -%}{{ m.role[0] }} {% endfor -%}|\
               {{- messages | length }}{% if loop is undefined %}!{% endif %}";
    let messages = [
        ChatMessage::new("system", "s"),
        ChatMessage::new("user", "u"),
        ChatMessage::new("assistant", "a"),
    ];
    assert_eq!(
        render_with(src, &messages, json!({})),
        "1|aus|s s>u u>a |3!"
    );
}

#[test]
fn defined_string_and_boolean_tests() {
    let src = "{% if enable_thinking is defined and enable_thinking is false %}off{% else %}on{% endif %}|\
               {{ messages[0].reasoning_content is defined }}|{{ messages[1].reasoning_content is string }}|\
               {{ messages[0].tool_calls is mapping }}";
    let mut with_reasoning = ChatMessage::new("assistant", "x");
    with_reasoning.reasoning_content = Some("why".into());
    let messages = [ChatMessage::new("user", "u"), with_reasoning];
    assert_eq!(
        render_with(src, &messages, json!({})),
        "on|False|True|False"
    );
    assert_eq!(
        render_with(src, &messages, json!({"enable_thinking": false})),
        "off|False|True|False"
    );
    assert_eq!(
        render_with(src, &messages, json!({"enable_thinking": true})),
        "on|False|True|False"
    );
}

#[test]
fn tojson_matches_python_and_keeps_key_order() {
    let src = "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{{ tools[0].function.parameters | tojson(indent=2) }}";
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & \"here\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let out = render_with(src, &[], json!({ "tools": tools }));
    assert_eq!(
        out,
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather <now> & \\\"here\\\"\", \
         \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n\
         {\n  \"type\": \"object\",\n  \"properties\": {\n    \"city\": {\n      \"type\": \"string\"\n    }\n  },\n  \"required\": [\n    \"city\"\n  ]\n}"
    );
}

#[test]
fn items_filter_and_dict_methods_iterate_in_order() {
    let src = "{% for k, v in messages[0].tool_calls[0].arguments | items %}{{ k }}={{ v }};{% endfor %}|\
               {% for k, v in messages[0].tool_calls[0].arguments.items() %}{{ k }}{% endfor %}|\
               {{ messages[0].tool_calls[0].arguments.get('zeta', 'none') }}";
    let mut m = ChatMessage::new("assistant", "");
    m.tool_calls = Some(json!([{"arguments": {"zeta": 1, "alpha": "b"}}]));
    assert_eq!(
        render_with(src, &[m], json!({})),
        "zeta=1;alpha=b;|zetaalpha|1"
    );
}

#[test]
fn raise_exception_surfaces_the_message() {
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}ok",
    )
    .expect("compiles");
    let err = t
        .render(&[ChatMessage::new("user", "u")], false, &no_kwargs())
        .unwrap_err();
    assert!(
        matches!(&err, ChatTemplateError::Raised(m) if m == "System first!"),
        "{err}"
    );
    assert_eq!(
        t.render(&[ChatMessage::new("system", "s")], false, &no_kwargs())
            .unwrap(),
        "ok"
    );
}

#[test]
fn syntax_and_runtime_errors_are_reported() {
    assert!(matches!(
        ChatTemplate::new("{% for %}"),
        Err(ChatTemplateError::Syntax(_))
    ));
    let t = ChatTemplate::new("{{ messages[0].content.nosuchmethod() }}").expect("compiles");
    assert!(matches!(
        t.render(&[ChatMessage::new("user", "u")], false, &no_kwargs()),
        Err(ChatTemplateError::Render(_))
    ));
}

#[test]
fn trim_and_lstrip_blocks_like_transformers() {
    let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}";
    let messages = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    assert_eq!(render_with(src, &messages, json!({})), "a\nb\n");
}

#[test]
fn special_token_variables() {
    let t = ChatTemplate::new("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
        .expect("compiles")
        .with_special_tokens("<s>", "</s>");
    assert_eq!(
        t.render(&[ChatMessage::new("user", "x")], false, &no_kwargs())
            .unwrap(),
        "<s>x</s>"
    );
}

#[test]
fn prefill_stops_after_the_final_content() {
    let t = ChatTemplate::chatml();
    let messages = [
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hel"),
    ];
    assert_eq!(
        t.render_prefill(&messages, &no_kwargs()).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel"
    );
    assert!(matches!(
        t.render_prefill(&[], &no_kwargs()),
        Err(ChatTemplateError::Prefill(_))
    ));
    let dropping =
        ChatTemplate::new("{% for m in messages %}{{ m.role }}{% endfor %}").expect("compiles");
    assert!(matches!(
        dropping.render_prefill(&messages, &no_kwargs()),
        Err(ChatTemplateError::Prefill(_))
    ));
}

#[test]
fn template_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
}
