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

/// All events of a transcript fed in these pieces, with adjacent texts joined and the streamed
/// arguments checked and left out: every call announced with `CallStart` is the next `Call`, and
/// the deltas sent for it begin its arguments JSON. Unfinished markup counts as text.
fn run(p: &mut ToolCallParser, pieces: &[&str]) -> (Vec<ToolEvent>, bool) {
    let mut events = Vec::new();
    for piece in pieces {
        events.extend(p.push(piece));
    }
    let (rest, unfinished) = p.finish();
    events.extend(rest);
    (join_text(check_streamed(events)), unfinished)
}

/// The events with the streaming ones checked (see [`run`]) and removed.
fn check_streamed(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut open: Option<(String, String)> = None;
    let mut out = Vec::new();
    for e in events {
        match e {
            ToolEvent::CallStart(name) => {
                assert!(open.is_none(), "a call started inside another");
                open = Some((name, String::new()));
            }
            ToolEvent::ArgumentsDelta(d) => {
                open.as_mut()
                    .expect("arguments outside a started call")
                    .1
                    .push_str(&d);
            }
            ToolEvent::Call(c) => {
                if let Some((name, sent)) = open.take() {
                    assert_eq!(c.name, name);
                    assert!(
                        c.arguments_json().starts_with(&sent),
                        "{sent:?} does not begin {:?}",
                        c.arguments_json()
                    );
                }
                out.push(ToolEvent::Call(c));
            }
            ToolEvent::Unfinished(t) => {
                assert!(
                    open.take().is_some(),
                    "unfinished markup of no started call"
                );
                out.push(ToolEvent::Text(t));
            }
            ToolEvent::Text(t) => out.push(ToolEvent::Text(t)),
        }
    }
    out
}

/// What a stream client assembles from the events: each call's name and arguments, from its
/// start, deltas and the rest the complete call carries.
fn assembled(events: &[ToolEvent]) -> Vec<(String, String)> {
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut open = false;
    for e in events {
        match e {
            ToolEvent::CallStart(name) => {
                calls.push((name.clone(), String::new()));
                open = true;
            }
            ToolEvent::ArgumentsDelta(d) => calls.last_mut().unwrap().1.push_str(d),
            ToolEvent::Call(c) => {
                let json = c.arguments_json();
                if open {
                    let sent = calls.last().unwrap().1.len();
                    calls.last_mut().unwrap().1.push_str(&json[sent..]);
                    open = false;
                } else {
                    calls.push((c.name.clone(), json));
                }
            }
            _ => {}
        }
    }
    calls
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

/// Fed one character at a time, an XML call is announced when its name is written, a string
/// argument goes out as it is written (never the newline and tag that close it), other values
/// when they are complete, and the pieces join into the complete call's arguments.
#[test]
fn arguments_stream_as_they_are_written() {
    let mut p = parser();
    let mut events = Vec::new();
    let mut announced_at = None;
    let mut city_seen_at = None;
    let mut sent = String::new();
    for (i, ch) in TWO_CALLS.char_indices() {
        let new = p.push(&ch.to_string());
        for e in &new {
            match e {
                ToolEvent::CallStart(_) if announced_at.is_none() => announced_at = Some(i),
                ToolEvent::ArgumentsDelta(d) => {
                    sent.push_str(d);
                    if sent.contains("Paulo") && city_seen_at.is_none() {
                        city_seen_at = Some(i);
                    }
                }
                _ => {}
            }
        }
        events.extend(new);
    }
    events.extend(p.finish().0);
    let function_tag = TWO_CALLS.find("<function=get_weather>").unwrap();
    assert_eq!(
        announced_at,
        Some(function_tag + "<function=get_weather>".len() - 1)
    );
    let value_end = TWO_CALLS.find("東京").unwrap();
    assert!(
        city_seen_at.unwrap() < value_end,
        "the city went out only at its end"
    );
    let deltas: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            ToolEvent::ArgumentsDelta(d) => Some(d.as_str()),
            _ => None,
        })
        .collect();
    assert!(deltas.len() > 10, "{deltas:?}");
    assert!(deltas
        .iter()
        .all(|d| !d.contains("</parameter") && !d.contains("\\n\"")));
    let calls = assembled(&events);
    let want: Vec<(String, String)> = two_calls_events()
        .into_iter()
        .filter_map(|e| match e {
            ToolEvent::Call(c) => Some((c.name.clone(), c.arguments_json())),
            _ => None,
        })
        .collect();
    assert_eq!(calls, want);
    assert_eq!(join_text(check_streamed(events)), two_calls_events());
}

/// Values that end in newlines or hold pieces of the closing tag, a call to a tool not offered
/// (not streamed), a repeated parameter and markup that stops parsing after the call was
/// announced: at every split the stream assembles the complete call's arguments.
#[test]
fn streamed_arguments_join_into_the_call_at_every_split() {
    let texts = [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\n\n</parame\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n\"quoted\" \\ back</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=unknown_tool>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\njunk\n</function>\n</tool_call>",
    ];
    for text in texts {
        let whole = {
            let mut p = parser();
            let mut ev = p.push(text);
            ev.extend(p.finish().0);
            ev
        };
        let want: Vec<(String, String)> = whole
            .iter()
            .filter_map(|e| match e {
                ToolEvent::Call(c) => Some((c.name.clone(), c.arguments_json())),
                _ => None,
            })
            .collect();
        assert_eq!(want.len(), 1, "{text}: {whole:?}");
        let bounds: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &a in &bounds {
            let mut p = parser();
            let mut ev = p.push(&text[..a]);
            ev.extend(p.push(&text[a..]));
            ev.extend(p.finish().0);
            assert_eq!(assembled(&ev), want, "{text}: split at {a}");
            check_streamed(ev);
        }
        let mut p = parser();
        let mut ev = Vec::new();
        for ch in text.chars() {
            ev.extend(p.push(&ch.to_string()));
        }
        ev.extend(p.finish().0);
        assert_eq!(assembled(&ev), want, "{text}: by characters");
    }
    // The repeated parameter: the first value stands; the junk: the parameters before it.
    let args = |text: &str| {
        let mut p = parser();
        let mut ev = p.push(text);
        ev.extend(p.finish().0);
        assembled(&ev)[0].1.clone()
    };
    assert_eq!(args(texts[3]), r#"{"city":"A"}"#);
    assert_eq!(args(texts[4]), r#"{"city":"Oslo"}"#);
    assert_eq!(
        args(texts[0]),
        r#"{"city":"line one\n\n</parame","days":2}"#
    );
}

/// Generation that stops inside a started call: the markup comes back as unfinished (text in a
/// whole answer), after the arguments written so far.
#[test]
fn a_started_call_left_unfinished() {
    let mut p = parser();
    let mut ev = p.push("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar");
    let (rest, unfinished) = p.finish();
    ev.extend(rest);
    assert!(unfinished);
    assert_eq!(ev[0], ToolEvent::Text("Sure.\n".into()));
    assert_eq!(ev[1], ToolEvent::CallStart("get_weather".into()));
    assert_eq!(
        ev.last(),
        Some(&ToolEvent::Unfinished(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar".into()
        ))
    );
    assert_eq!(
        assembled(&ev),
        [("get_weather".to_string(), r#"{"city":"Par"#.to_string())]
    );
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
    let req = crate::request::parse_chat(openai_form.as_object().unwrap(), None).unwrap();
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
