use super::*;

fn weather() -> Tool {
    Tool {
        name: "get_weather".into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "ratio": {"type": "number"},
                "hourly": {"type": "boolean"},
                "extra": {"type": "object"},
                "tags": {"type": "array"},
                "note": {"type": ["string", "null"]},
                "unit": {"enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city"]
        }),
    }
}

fn now() -> Tool {
    Tool {
        name: "now".into(),
        parameters: json!({"type": "object", "properties": {}}),
    }
}

fn parser() -> ToolCallParser {
    ToolCallParser::new(vec![weather(), now()], None)
}

/// All events of a transcript fed in one piece, with adjacent texts joined.
fn run(p: &mut ToolCallParser, pieces: &[&str]) -> (Vec<ToolEvent>, bool) {
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(p.push(piece));
    }
    let (rest, unfinished) = p.finish();
    events.extend(rest);
    (join_text(events), unfinished)
}

fn join_text(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (Some(ToolEvent::Text(a)), ToolEvent::Text(b)) => a.push_str(&b),
            (_, ToolEvent::Text(b)) if b.is_empty() => {}
            (_, e) => out.push(e),
        }
    }
    out
}

fn call(name: &str, args: Value) -> ToolEvent {
    ToolEvent::Call(ToolCall {
        name: name.into(),
        arguments: args.as_object().unwrap().clone(),
    })
}

const TWO_CALLS: &str = "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo — 東京\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n<parameter=extra>\n{\"x\": [1, 2.5, null], \"y\": {\"z\": \"<b>\"}}\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>";

fn two_calls_events() -> Vec<ToolEvent> {
    vec![
        ToolEvent::Text("I will check.\n".into()),
        call(
            "get_weather",
            json!({
                "city": "São Paulo — 東京",
                "days": 3,
                "ratio": 0.5,
                "hourly": true,
                "extra": {"x": [1, 2.5, null], "y": {"z": "<b>"}},
                "tags": ["a", "b"],
                "note": null,
                "unit": "celsius"
            }),
        ),
        ToolEvent::Text("\n".into()),
        call("now", json!({})),
    ]
}

#[test]
fn xml_calls_with_typed_arguments_after_text() {
    let (events, unfinished) = run(&mut parser(), &[TWO_CALLS]);
    assert!(!unfinished);
    assert_eq!(events, two_calls_events());
}

/// Wherever the stream is cut (every byte boundary that is a character boundary, into two and
/// into three pieces), the same text and calls come out, and no markup is ever text.
#[test]
fn every_split_point_gives_the_same_events() {
    let transcripts: Vec<(&str, Vec<ToolEvent>)> = vec![
        (TWO_CALLS, two_calls_events()),
        (
            "<think>\nLet me call it.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n</think>\n\nDone.",
            vec![
                ToolEvent::Text("<think>\nLet me call it.\n".into()),
                call("now", json!({})),
                ToolEvent::Text("\n</think>\n\nDone.".into()),
            ],
        ),
        (
            "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>tail",
            vec![
                call("get_weather", json!({"city": "Rome"})),
                ToolEvent::Text("tail".into()),
            ],
        ),
    ];
    for (text, want) in transcripts {
        let bounds: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &a in &bounds {
            let (events, _) = run(&mut parser(), &[&text[..a], &text[a..]]);
            assert_eq!(events, want, "split at {a}");
            for e in &events {
                if let ToolEvent::Text(t) = e {
                    assert!(
                        !t.contains("<tool_call>") && !t.contains("<function="),
                        "{t:?}"
                    );
                }
            }
        }
        for &a in bounds.iter().step_by(7) {
            for &b in bounds.iter().filter(|&&b| b >= a).step_by(5) {
                let (events, _) = run(&mut parser(), &[&text[..a], &text[a..b], &text[b..]]);
                assert_eq!(events, want, "split at {a}, {b}");
            }
        }
        // One character at a time.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&mut parser(), &pieces).0, want);
    }
}

#[test]
fn json_form_and_arguments_as_a_string() {
    let (events, _) = run(
        &mut parser(),
        &["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}\n</tool_call>"],
    );
    assert_eq!(events, vec![call("get_weather", json!({"city": "Oslo"}))]);
    let (events, _) = run(
        &mut parser(),
        &["<tool_call>{\"name\": \"now\", \"parameters\": {\"tz\": \"UTC\"}}</tool_call>"],
    );
    assert_eq!(events, vec![call("now", json!({"tz": "UTC"}))]);
}

#[test]
fn unfinished_and_malformed_markup_stay_text() {
    let cut = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
    let (events, unfinished) = run(&mut parser(), &[cut]);
    assert!(unfinished);
    assert_eq!(events, vec![ToolEvent::Text(cut.into())]);
    let bad = "<tool_call>\nnot a call\n</tool_call> after";
    let (events, unfinished) = run(&mut parser(), &[bad]);
    assert!(!unfinished);
    assert_eq!(events, vec![ToolEvent::Text(bad.into())]);
    // A partial marker at the very end is text too.
    let (events, unfinished) = run(&mut parser(), &["x <tool_ca"]);
    assert!(!unfinished);
    assert_eq!(events, vec![ToolEvent::Text("x <tool_ca".into())]);
}

#[test]
fn only_the_first_call_without_parallel_calls() {
    let mut p = ToolCallParser::new(vec![weather(), now()], Some(1));
    let (events, _) = run(&mut p, &[TWO_CALLS]);
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, ToolEvent::Call(_)))
            .count(),
        1
    );
    assert_eq!(p.calls(), 2);
}

#[test]
fn values_take_the_declared_type() {
    assert_eq!(
        typed_value("12", Some(&json!({"type": "integer"}))),
        json!(12)
    );
    assert_eq!(
        typed_value("12.0", Some(&json!({"type": "integer"}))),
        json!(12)
    );
    assert_eq!(
        typed_value("12", Some(&json!({"type": "string"}))),
        json!("12")
    );
    assert_eq!(
        typed_value("12", Some(&json!({"type": ["integer", "string"]}))),
        json!(12)
    );
    assert_eq!(
        typed_value("x12", Some(&json!({"type": ["integer", "string"]}))),
        json!("x12")
    );
    assert_eq!(
        typed_value("-1.5e3", Some(&json!({"type": "number"}))),
        json!(-1500.0)
    );
    assert_eq!(
        typed_value("FALSE", Some(&json!({"type": "boolean"}))),
        json!(false)
    );
    assert_eq!(
        typed_value("None", Some(&json!({"type": "null"}))),
        json!(null)
    );
    assert_eq!(
        typed_value(" [1,2] ", Some(&json!({"type": "array"}))),
        json!([1, 2])
    );
    assert_eq!(
        typed_value(
            "{\"a\": 1}",
            Some(&json!({"anyOf": [{"type": "object"}, {"type": "null"}]}))
        ),
        json!({"a": 1})
    );
    assert_eq!(
        typed_value("2", Some(&json!({"enum": [1, 2, 3]}))),
        json!(2)
    );
    // Not what the schema says: the text as it is.
    assert_eq!(
        typed_value("many", Some(&json!({"type": "integer"}))),
        json!("many")
    );
    // No schema: JSON values decoded, other text kept.
    assert_eq!(typed_value("true", None), json!(true));
    assert_eq!(typed_value("hello", None), json!("hello"));
    assert_eq!(typed_value("\"quoted\"", None), json!("\"quoted\""));
}

#[test]
fn tools_and_tool_choice_are_checked() {
    let o = |v: Value| v.as_object().unwrap().clone();
    let (tools, for_template) = parse_tools(&o(json!({
        "tools": [{"type": "function", "function": {"name": "now"}}]
    })))
    .unwrap();
    assert_eq!(
        tools[0].parameters,
        json!({"type": "object", "properties": {}})
    );
    assert_eq!(for_template[0]["function"]["name"], "now");
    let (tools, for_template) = parse_tools(&o(
        json!({"functions": [{"name": "f", "parameters": {"type": "object"}}]}),
    ))
    .unwrap();
    assert_eq!(tools[0].name, "f");
    assert_eq!(for_template[0]["type"], "function");
    for bad in [
        json!({"tools": {}}),
        json!({"tools": [{"type": "retrieval"}]}),
        json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
        json!({"tools": [{"type": "function", "function": {"name": "x"}}, {"type": "function", "function": {"name": "x"}}]}),
        json!({"tools": [{"type": "function", "function": {"name": "x", "parameters": 3}}]}),
    ] {
        assert!(parse_tools(&o(bad.clone())).is_err(), "{bad}");
    }
    let tools = vec![now()];
    assert_eq!(
        parse_tool_choice(&o(json!({})), &tools).unwrap(),
        ToolChoice::Auto
    );
    assert_eq!(
        parse_tool_choice(&o(json!({"tool_choice": "required"})), &tools).unwrap(),
        ToolChoice::Required
    );
    assert_eq!(
        parse_tool_choice(
            &o(json!({"tool_choice": {"type": "function", "function": {"name": "now"}}})),
            &tools
        )
        .unwrap(),
        ToolChoice::Named("now".into())
    );
    assert_eq!(
        parse_tool_choice(&o(json!({"function_call": {"name": "now"}})), &tools).unwrap(),
        ToolChoice::Named("now".into())
    );
    assert!(parse_tool_choice(&o(json!({"tool_choice": "required"})), &[]).is_err());
    assert!(parse_tool_choice(
        &o(json!({"tool_choice": {"function": {"name": "zz"}}})),
        &tools
    )
    .is_err());
    assert!(parse_tool_choice(&o(json!({"tool_choice": "sometimes"})), &tools).is_err());
}

#[test]
fn arguments_strings_become_mappings_for_templates() {
    let calls = json!([{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                       {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]);
    let t = arguments_for_template(&calls);
    assert_eq!(t[0]["function"]["arguments"], json!({"a": 1}));
    assert_eq!(t[1]["function"]["arguments"], json!("not json"));
}

#[test]
fn template_decides_the_format() {
    assert_eq!(
        ToolFormat::of_template("...<function=...>..."),
        ToolFormat::Xml
    );
    assert_eq!(
        ToolFormat::of_template(
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
        ),
        ToolFormat::Json
    );
    assert_eq!(ToolFormat::of_template("{{ messages }}"), ToolFormat::Xml);
}

mod grammar {
    use super::*;
    use nextn_engine::grammar::{Constraint, GrammarCompiler, GrammarSource};
    use nextn_engine::tokenizer::Tokenizer;

    fn compiler() -> (GrammarCompiler, Tokenizer) {
        let file = nextn_gguf::GgufFile::open(nextn_testdata::bundled_model()).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        (GrammarCompiler::new(&tok, 8192).unwrap(), tok)
    }

    /// Follow the grammar taking the first allowed token each time: the text it forces.
    fn walk(c: &mut Constraint, tok: &Tokenizer) -> String {
        let mut out = Vec::new();
        for _ in 0..400 {
            if c.is_finished() {
                break;
            }
            let t = c.mask().unwrap().first().unwrap();
            if tok.is_eog(t) {
                break;
            }
            c.consume(t).unwrap();
            out.push(t);
        }
        tok.decode(&out)
    }

    fn enum_tool() -> Tool {
        Tool {
            name: "set_mode".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "mode": {"enum": ["fast"]},
                    "level": {"const": 3},
                    "flag": {"const": true}
                },
                "required": ["mode", "level", "flag"]
            }),
        }
    }

    #[test]
    fn a_named_tool_with_fixed_arguments_forces_one_parseable_call() {
        let (g, tok) = compiler();
        for format in [ToolFormat::Xml, ToolFormat::Json] {
            let lark = call_grammar(
                &[weather(), enum_tool()],
                Some("set_mode"),
                format,
                false,
                Reasoning::None,
            );
            let mut c = g.compile(&GrammarSource::Grammar(lark.clone())).unwrap();
            let text = walk(&mut c, &tok);
            let mut p = ToolCallParser::new(vec![weather(), enum_tool()], None);
            let (events, unfinished) = run(&mut p, &[&text]);
            assert!(!unfinished, "{format:?}: {text}");
            assert_eq!(
                events,
                vec![call(
                    "set_mode",
                    json!({"mode": "fast", "level": 3, "flag": true})
                )],
                "{format:?}: {text}\n{lark}"
            );
        }
    }

    #[test]
    fn grammars_for_every_parameter_type_compile() {
        let (g, _) = compiler();
        for format in [ToolFormat::Xml, ToolFormat::Json] {
            for (parallel, reasoning) in [
                (false, Reasoning::None),
                (true, Reasoning::Optional),
                (true, Reasoning::Open),
            ] {
                let lark = call_grammar(&[weather(), now()], None, format, parallel, reasoning);
                g.compile(&GrammarSource::Grammar(lark.clone()))
                    .unwrap_or_else(|e| panic!("{format:?}: {e}\n{lark}"));
            }
        }
    }
}

/// A conversation as OpenAI clients send it (arguments as JSON strings, tool results as content
/// parts) renders through the Qwen-style templates exactly as the same conversation with
/// arguments as mappings, which the engine's template tests hold equal to Python Jinja2.
#[test]
fn openai_tool_turns_render_as_the_templates_expect() {
    use nextn_engine::chat::{ChatMessage, ChatTemplate};
    let templates = [
        include_str!("../../../nextn-engine/tests/data/qwen3_chat_template.jinja"),
        include_str!("../../../nextn-engine/tests/data/xml_tools_chat_template.jinja"),
    ];
    let args = json!({"city": "Paris", "days": 2, "extra": {"x": [1, 2.5, null]}});
    let openai_form = json!({
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args.to_string()}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "{\"temp\": 21}"}]},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
            {"role": "user", "content": "Thanks!"}
        ],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "description": "Current weather.", "parameters": weather().parameters}},
            {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
        ]
    });
    let req = crate::request::parse_chat(openai_form.as_object().unwrap()).unwrap();
    let mut kwargs = Map::new();
    kwargs.insert("tools".into(), req.tools_for_template.clone());
    let mapping_form: Vec<ChatMessage> = req
        .messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(calls) = &mut m.tool_calls {
                calls[0]["function"]["arguments"] = args.clone();
                calls[1]["function"]["arguments"] = json!({});
            }
            m
        })
        .collect();
    for source in templates {
        let t = ChatTemplate::new(source).unwrap();
        let got = t.render(&req.messages, true, &kwargs).unwrap();
        let want = t.render(&mapping_form, true, &kwargs).unwrap();
        assert_eq!(got, want);
        assert!(
            got.contains("Paris") && got.contains("12:00") && got.contains("{\"temp\": 21}"),
            "{got}"
        );
    }
}
