//! The typed request every API builds. Each API has a front end that reads its own body into
//! these types ([`chat::parse_chat`] and [`completion::parse_completion`] here, Anthropic's
//! Messages in `crate::anthropic`, OpenAI's Responses in `crate::responses`), and each part
//! remembers the field it came from in that API's terms, so an error found later (an image that
//! does not decode, a grammar that does not compile) names the client's own field. Every field the
//! server reads is listed in crates/nextn-server/README.md; unknown fields are ignored and named
//! in the debug log ([`unknown`]).

pub mod chat;
pub mod completion;
pub(crate) mod fields;
pub mod images;
pub mod params;
pub(crate) mod unknown;

pub use chat::{parse_chat, ChatRequest};
pub use completion::{parse_completion, CompletionRequest, Prompt};
pub(crate) use fields::flag;
pub use fields::parse_json;
pub use images::{image_from_url, ChatImage, ImageSource};
pub(crate) use params::fresh_seed;
pub use params::{BiasKey, GenParams, MAX_TOP_LOGPROBS};

/// Fields an OpenAI chat or text completion body may have that the server reads (or checks).
pub(crate) const KNOWN_FIELDS: &[&str] = &[
    "return_tokens",
    "return_progress",
    "cache_prompt",
    "forced_acceptance_reference",
    "model",
    "messages",
    "prompt",
    "n_predict",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "min_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "seed",
    "stop",
    "n",
    "logprobs",
    "top_logprobs",
    "n_probs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "json_schema",
    "grammar",
    "logit_bias",
    "stream",
    "stream_options",
    "ignore_eos",
    "chat_template_kwargs",
    "reasoning_format",
    "thinking_budget_tokens",
    "echo",
    "best_of",
    "suffix",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "typical_p",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "xtc_probability",
    "xtc_threshold",
    "top_n_sigma",
    "dynatemp_range",
    "dynatemp_exponent",
    "tfs_z",
    "samplers",
    "min_keep",
    "post_sampling_probs",
    "lora",
    "penalize_nl",
];

#[cfg(test)]
mod tests {
    use super::fields::{Fields, Names};
    use super::*;
    use crate::tools::ToolChoice;
    use crate::ReasoningFormat;
    use nextn_engine::grammar::GrammarSource;
    use serde_json::{json, Map, Value};

    fn parse_params(o: &Map<String, Value>) -> Result<GenParams, crate::error::ApiError> {
        params::parse_params(&Fields::request(o, Names::Same, None))
    }

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn chat_fields_map_to_sampler_and_budget() {
        let r = parse_chat(&obj(json!({
            "model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 9,
            "stop": "END", "presence_penalty": 0.5, "frequency_penalty": -0.5, "stream": true,
            "stream_options": {"include_usage": true}, "chat_template_kwargs": {"enable_thinking": false}, "user": "ignored"
        })), None)
        .unwrap();
        assert_eq!(r.messages[1].content, "ab");
        let p = &r.params;
        assert_eq!(
            (
                p.n_predict,
                p.sampler.temperature,
                p.sampler.top_p,
                p.sampler.top_k,
                p.sampler.seed
            ),
            (Some(7), 0.0, 0.5, 3, 9)
        );
        assert_eq!(
            (
                p.sampler.min_p,
                p.sampler.presence_penalty,
                p.sampler.frequency_penalty
            ),
            (0.1, 0.5, -0.5)
        );
        assert_eq!(p.stop, vec!["END".to_string()]);
        assert!(p.stream && p.include_usage);
        assert_eq!(r.template_kwargs["enable_thinking"], false);
    }

    #[test]
    fn wrong_fields_name_themselves() {
        let cases = [
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_p": 2}),
                "top_p",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stop": [1]}),
                "stop",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
                "n",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
                "stream",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}),
                "chat_template_kwargs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": "lots"}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": {"a": 1}}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": -5}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n_probs": 50}),
                "n_probs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": 21}),
                "logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}),
                "logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "mirostat": 2}),
                "mirostat",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "dry_multiplier": 0.8}),
                "dry_multiplier",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "xtc_probability": 0.5}),
                "xtc_probability",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "typical_p": 0.9}),
                "typical_p",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "samplers": ["top_k"]}),
                "samplers",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "best_of": 3}),
                "best_of",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}),
                "response_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}),
                "grammar",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "grammar": 5}),
                "grammar",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"12": "x"}}),
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": [[1]]}),
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "reasoning_format": "xml"}),
                "reasoning_format",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "json_schema": {}}),
                "tool_choice",
            ),
        ];
        for (body, param) in cases {
            let e = parse_chat(&obj(body.clone()), None).expect_err(&body.to_string());
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        // Values that turn a sampler off are fine: clients send them all.
        for ok in [
            json!({"n_probs": 0}),
            json!({"n_probs": null}),
            json!({"logprobs": false}),
            json!({"logprobs": 0}),
            json!({"mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1, "typical_p": 1,
                   "dry_multiplier": 0, "dry_base": 1.75, "xtc_probability": 0, "xtc_threshold": 0.1,
                   "top_n_sigma": -1, "dynatemp_range": 0, "min_keep": 0, "samplers": []}),
        ] {
            assert!(parse_params(&obj(ok.clone())).is_ok(), "{ok}");
        }
        assert!(parse_json(b"{not json").is_err());
        assert!(parse_json(b"[1]").is_err());
    }

    #[test]
    fn logprobs_grammars_and_bias_in_every_spelling() {
        let p = |v: Value| parse_params(&obj(v)).unwrap();
        assert_eq!(p(json!({"logprobs": true})).logprobs, Some(0));
        assert_eq!(
            p(json!({"logprobs": true, "top_logprobs": 5})).logprobs,
            Some(5)
        );
        assert_eq!(p(json!({"logprobs": 3})).logprobs, Some(3));
        assert_eq!(p(json!({"n_probs": 4})).logprobs, Some(4));
        assert_eq!(p(json!({})).logprobs, None);
        assert_eq!(
            p(json!({"response_format": {"type": "json_object"}})).grammar,
            Some(GrammarSource::JsonObject)
        );
        assert_eq!(
            p(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": true}}})).grammar,
            Some(GrammarSource::JsonSchema(json!({"type": "integer"})))
        );
        assert_eq!(
            p(json!({"response_format": {"type": "json_object", "schema": {"type": "string"}}}))
                .grammar,
            Some(GrammarSource::JsonSchema(json!({"type": "string"})))
        );
        assert_eq!(
            p(json!({"json_schema": {"type": "array"}})).grammar,
            Some(GrammarSource::JsonSchema(json!({"type": "array"})))
        );
        assert_eq!(
            p(json!({"grammar": "root ::= \"x\""})).grammar,
            Some(GrammarSource::Grammar("root ::= \"x\"".into()))
        );
        assert_eq!(
            p(json!({"response_format": {"type": "text"}})).grammar,
            None
        );
        assert_eq!(
            p(json!({"logit_bias": {"15": -100, "Hello": 5.5, "7": false, "9": 300}})).logit_bias,
            vec![
                (BiasKey::Id(15), -100.0),
                (BiasKey::Text("Hello".into()), 5.5),
                (BiasKey::Id(7), f32::NEG_INFINITY),
                (BiasKey::Id(9), 100.0),
            ]
        );
        assert_eq!(
            p(json!({"logit_bias": [[15, -1], ["hi", 2]]})).logit_bias,
            vec![(BiasKey::Id(15), -1.0), (BiasKey::Text("hi".into()), 2.0)]
        );
        assert_eq!(
            p(json!({"reasoning_format": "none"})).reasoning,
            Some(ReasoningFormat::None)
        );
        assert_eq!(
            p(json!({"reasoning_format": "deepseek"})).reasoning,
            Some(ReasoningFormat::Deepseek)
        );
    }

    #[test]
    fn tool_fields_and_legacy_functions() {
        let r = parse_chat(&obj(json!({
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "21"}]}
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": false
        })), None)
        .unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Named("get_weather".into()));
        assert!(!r.parallel_tool_calls && !r.legacy_functions);
        let calls = r.messages[1].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Paris"}));
        assert_eq!(r.messages[2].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(r.messages[2].content, "21");
        let r = parse_chat(&obj(json!({
            "messages": [{"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": "{}"}}],
            "functions": [{"name": "f"}],
            "function_call": "auto"
        })), None)
        .unwrap();
        assert!(r.legacy_functions);
        assert_eq!(r.tool_choice, ToolChoice::Auto);
        assert_eq!(
            r.messages[0].tool_calls.as_ref().unwrap()[0]["function"]["name"],
            "f"
        );
    }

    /// http(s) image URLs are kept for the handler to fetch (or refuse); other schemes and
    /// relative URLs are refused while parsing, naming the field.
    #[test]
    fn image_urls_are_kept_for_fetching_and_other_schemes_refused() {
        let field = "messages[0].content[1].image_url.url";
        let remote = |u: &str| {
            image_from_url(u, field)
                .unwrap()
                .remote_url()
                .map(String::from)
        };
        assert_eq!(
            remote("http://127.0.0.1:8000/a.png").as_deref(),
            Some("http://127.0.0.1:8000/a.png")
        );
        // Schemes and hosts are case-insensitive.
        assert_eq!(
            remote("HTTPS://Example.COM/b.jpg?x=1").as_deref(),
            Some("https://example.com/b.jpg?x=1")
        );
        let inline = image_from_url("DATA:image/png;base64,iVBORw==", field).unwrap();
        assert_eq!(inline.bytes().unwrap(), &[0x89, b'P', b'N', b'G'][..]);
        for (url, words) in [
            ("ftp://example.com/a.png", "'ftp:'"),
            ("file:///etc/passwd", "'file:'"),
            ("gopher://example.com/", "only http:// and https://"),
            ("/images/a.png", "a data URI or an http(s) URL"),
            ("cat.png", "a data URI or an http(s) URL"),
            ("http://", "not a valid URL"),
            ("https://exa mple.com/a.png", "not a valid URL"),
        ] {
            let e = image_from_url(url, field).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{url}");
            assert_eq!(e.param.as_deref(), Some(field), "{url}");
            assert!(e.message.starts_with(field), "{url}: {}", e.message);
            assert!(e.message.contains(words), "{url}: {}", e.message);
        }
        let r = parse_chat(
            &obj(json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}},
                {"type": "image_url", "image_url": "data:image/png;base64,iVBORw=="},
            ]}]})),
            None,
        )
        .unwrap();
        assert_eq!(r.images.len(), 2);
        assert_eq!(r.images[0].remote_url(), Some("https://example.com/b.jpg"));
        assert_eq!(r.images[0].field, field);
        assert_eq!(r.images[1].field, "messages[0].content[2].image_url.url");
        // An image still behind its URL has no bytes: preparing it would be the server's bug.
        let e = r.images[0].bytes().unwrap_err();
        assert_eq!(e.status, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        assert!(r.images[1].bytes().is_ok());
    }

    #[test]
    fn completion_prompts_in_every_shape() {
        let p = |v: Value| parse_completion(&obj(json!({"prompt": v})), None).map(|r| r.prompt);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([[3]])).unwrap(), Prompt::Tokens(vec![3]));
        assert!(p(json!(["a", "b"])).is_err());
        assert!(p(json!([-1])).is_err());
        assert!(p(json!(3)).is_err());
        assert!(parse_completion(&obj(json!({})), None).is_err());
    }

    #[test]
    fn unseeded_requests_get_distinct_seeds() {
        let a = parse_params(&Map::new()).unwrap().sampler.seed;
        let b = parse_params(&Map::new()).unwrap().sampler.seed;
        assert_ne!(a, b);
        assert_eq!(
            parse_params(&obj(json!({"max_tokens": -1})))
                .unwrap()
                .n_predict,
            None
        );
    }
}
