//! The answer's parts (reasoning, text, tool calls, from the chat completion's shaping) as
//! Responses output items, and, for a stream, the events that build them: an item is added,
//! grows by deltas and is done before the next one begins.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::respond::Part;
use crate::tools::ToolCall;

use std::sync::Arc;

use super::sealed::Sealer;

/// Where an open item stands.
enum Open {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    /// A function call being written: its index among the answer's calls, item id, call id,
    /// name (as the model knows it) and the arguments so far.
    Call {
        index: usize,
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        /// Whether an arguments delta has been sent: a call is done only after at least one.
        streamed: bool,
    },
}

/// Builds the output items of one response.
pub(crate) struct Output {
    /// Distinguishes this response's item ids.
    stem: String,
    items: Vec<Value>,
    open: Option<Open>,
    /// Events not yet sent (without `sequence_number`).
    events: Vec<Value>,
    namespaced: HashMap<String, (String, String)>,
    /// Seals each reasoning item's text into its `encrypted_content`, when the request asked
    /// for it.
    sealer: Option<Arc<Sealer>>,
    /// The reasoning text of the whole answer (for `reasoning_tokens`).
    reasoning: String,
}

/// A `function_call` item; a namespaced function is named by its own name and its namespace.
fn call_item(
    namespaced: &HashMap<String, (String, String)>,
    id: &str,
    call_id: &str,
    name: &str,
    arguments: &str,
    status: &str,
) -> Value {
    let mut item = json!({
        "type": "function_call", "id": id, "call_id": call_id,
        "name": name, "arguments": arguments, "status": status,
    });
    if let Some((ns, own)) = namespaced.get(name) {
        item["name"] = json!(own);
        item["namespace"] = json!(ns);
    }
    item
}

impl Output {
    pub fn new(
        stem: &str,
        namespaced: HashMap<String, (String, String)>,
        sealer: Option<Arc<Sealer>>,
    ) -> Self {
        Output {
            stem: stem.to_string(),
            items: Vec::new(),
            open: None,
            events: Vec::new(),
            namespaced,
            sealer,
            reasoning: String::new(),
        }
    }

    fn next_id(&self, prefix: &str) -> String {
        format!("{prefix}_{}{:03}", self.stem, self.items.len())
    }

    /// The output index of the open item (the one after the finished ones).
    fn index(&self) -> usize {
        self.items.len()
    }

    fn event(&mut self, kind: &str, mut body: Value) {
        body["type"] = json!(kind);
        self.events.push(body);
    }

    /// The finished items.
    pub fn items(&self) -> &[Value] {
        &self.items
    }

    pub fn reasoning_text(&self) -> &str {
        &self.reasoning
    }

    /// The events produced since the last call.
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }

    /// Add the next parts of the answer; `calls` are the answer's complete calls so far (a call
    /// that has become complete is closed).
    pub fn push(&mut self, parts: Vec<Part>, calls: &[(String, ToolCall)]) {
        for p in parts {
            match p {
                Part::Reasoning(t) => self.reasoning_delta(t),
                Part::Content(t) => self.text_delta(t),
                Part::CallStart { index, id, name } => self.start_call(index, id, name),
                Part::CallArguments { index, text } => self.arguments_delta(index, text),
            }
            self.close_complete_call(calls);
        }
    }

    fn reasoning_delta(&mut self, delta: String) {
        self.reasoning.push_str(&delta);
        if !matches!(self.open, Some(Open::Reasoning { .. })) {
            self.close("completed");
            let id = self.next_id("rs");
            let output_index = self.index();
            self.event(
                "response.output_item.added",
                json!({"output_index": output_index, "item": {
                    "type": "reasoning", "id": id, "summary": [], "content": [], "status": "in_progress",
                }}),
            );
            self.event(
                "response.content_part.added",
                json!({"output_index": output_index, "item_id": id, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": ""}}),
            );
            self.open = Some(Open::Reasoning {
                id,
                text: String::new(),
            });
        }
        let output_index = self.index();
        if let Some(Open::Reasoning { id, text }) = &mut self.open {
            text.push_str(&delta);
            let id = id.clone();
            self.event(
                "response.reasoning_text.delta",
                json!({"output_index": output_index, "item_id": id, "content_index": 0, "delta": delta}),
            );
        }
    }

    fn text_delta(&mut self, delta: String) {
        if !matches!(self.open, Some(Open::Message { .. })) {
            self.close("completed");
            let id = self.next_id("msg");
            let output_index = self.index();
            self.event(
                "response.output_item.added",
                json!({"output_index": output_index, "item": {
                    "type": "message", "id": id, "role": "assistant", "status": "in_progress", "content": [],
                }}),
            );
            self.event(
                "response.content_part.added",
                json!({"output_index": output_index, "item_id": id, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            );
            self.open = Some(Open::Message {
                id,
                text: String::new(),
            });
        }
        let output_index = self.index();
        if let Some(Open::Message { id, text }) = &mut self.open {
            text.push_str(&delta);
            let id = id.clone();
            self.event(
                "response.output_text.delta",
                json!({"output_index": output_index, "item_id": id, "content_index": 0,
                       "delta": delta, "logprobs": []}),
            );
        }
    }

    fn start_call(&mut self, index: usize, call_id: String, name: String) {
        self.close("completed");
        let id = self.next_id("fc");
        let item = call_item(&self.namespaced, &id, &call_id, &name, "", "in_progress");
        let output_index = self.index();
        self.event(
            "response.output_item.added",
            json!({"output_index": output_index, "item": item}),
        );
        self.open = Some(Open::Call {
            index,
            id,
            call_id,
            name,
            arguments: String::new(),
            streamed: false,
        });
    }

    fn arguments_delta(&mut self, index: usize, delta: String) {
        let output_index = self.index();
        if let Some(Open::Call {
            index: open,
            id,
            arguments,
            streamed,
            ..
        }) = &mut self.open
        {
            if *open == index {
                arguments.push_str(&delta);
                *streamed = true;
                let id = id.clone();
                self.event(
                    "response.function_call_arguments.delta",
                    json!({"output_index": output_index, "item_id": id, "delta": delta}),
                );
            }
        }
    }

    /// The open call is done once the parser reports it complete; its arguments are then the
    /// complete call's.
    fn close_complete_call(&mut self, calls: &[(String, ToolCall)]) {
        if let Some(Open::Call {
            index, arguments, ..
        }) = &mut self.open
        {
            if let Some((_, call)) = calls.get(*index) {
                *arguments = call.arguments_json();
                self.close("completed");
            }
        }
    }

    /// Finish the open item with `status`.
    pub fn close(&mut self, status: &str) {
        let output_index = self.index();
        let Some(open) = self.open.take() else {
            return;
        };
        let item = match open {
            Open::Reasoning { id, text } => {
                self.event(
                    "response.reasoning_text.done",
                    json!({"output_index": output_index, "item_id": id, "content_index": 0, "text": text}),
                );
                self.event(
                    "response.content_part.done",
                    json!({"output_index": output_index, "item_id": id, "content_index": 0,
                           "part": {"type": "reasoning_text", "text": text}}),
                );
                let mut item = json!({
                    "type": "reasoning", "id": id, "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}], "status": status,
                });
                if let Some(sealed) = self.sealer.as_ref().and_then(|s| s.seal(&text)) {
                    item["encrypted_content"] = json!(sealed);
                }
                item
            }
            Open::Message { id, text } => {
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                self.event(
                    "response.output_text.done",
                    json!({"output_index": output_index, "item_id": id, "content_index": 0,
                           "text": text, "logprobs": []}),
                );
                self.event(
                    "response.content_part.done",
                    json!({"output_index": output_index, "item_id": id, "content_index": 0, "part": part}),
                );
                json!({"type": "message", "id": id, "role": "assistant", "status": status, "content": [part]})
            }
            Open::Call {
                id,
                call_id,
                name,
                arguments,
                streamed,
                ..
            } => {
                // A call parsed whole in one chunk still gets its arguments as one delta, as
                // clients that build calls from deltas expect.
                if !streamed {
                    self.event(
                        "response.function_call_arguments.delta",
                        json!({"output_index": output_index, "item_id": id, "delta": arguments}),
                    );
                }
                self.event(
                    "response.function_call_arguments.done",
                    json!({"output_index": output_index, "item_id": id, "arguments": arguments}),
                );
                call_item(&self.namespaced, &id, &call_id, &name, &arguments, status)
            }
        };
        self.event(
            "response.output_item.done",
            json!({"output_index": output_index, "item": item}),
        );
        self.items.push(item);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tools::test_call as call;

    fn kinds(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn reasoning_text_and_a_call_become_three_items_in_order() {
        let mut out = Output::new("x", HashMap::new(), None);
        out.push(
            vec![
                Part::Reasoning("think".into()),
                Part::Reasoning("ing".into()),
            ],
            &[],
        );
        out.push(vec![Part::Content("Hi".into())], &[]);
        let c = call("f", json!({"a": 1}));
        out.push(
            vec![
                Part::CallStart {
                    index: 0,
                    id: "call_1".into(),
                    name: "f".into(),
                },
                Part::CallArguments {
                    index: 0,
                    text: "{\"a\":".into(),
                },
            ],
            &[],
        );
        out.push(
            vec![Part::CallArguments {
                index: 0,
                text: "1}".into(),
            }],
            &[("call_1".into(), c)],
        );
        out.close("completed");
        let events = out.take_events();
        assert_eq!(
            kinds(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        let items = out.items();
        assert_eq!(items.len(), 3);
        assert_eq!(items[0]["content"][0]["text"], "thinking");
        assert_eq!(items[1]["content"][0]["text"], "Hi");
        assert_eq!(items[2]["arguments"], "{\"a\":1}");
        assert_eq!(items[2]["call_id"], "call_1");
        assert!(items[2]["id"].as_str().unwrap().starts_with("fc_"));
        // Every event of an item names its output index.
        assert!(events[14..].iter().all(
            |e| e["output_index"] == 2 && e.get("item_id").is_none_or(|i| *i == items[2]["id"])
        ));
        assert_eq!(out.reasoning_text(), "thinking");
    }

    #[test]
    fn namespaced_calls_carry_their_namespace_and_reasoning_its_encoding() {
        let ns = HashMap::from([(
            "agents.close".to_string(),
            ("agents".to_string(), "close".to_string()),
        )]);
        let sealer = Arc::new(Sealer::new().unwrap());
        let mut out = Output::new("y", ns, Some(sealer.clone()));
        out.push(vec![Part::Reasoning("r".into())], &[]);
        out.push(
            vec![Part::CallStart {
                index: 0,
                id: "call_2".into(),
                name: "agents.close".into(),
            }],
            &[],
        );
        // Generation stopped inside the call.
        out.close("incomplete");
        let items = out.items();
        let sealed = items[0]["encrypted_content"].as_str().unwrap();
        assert_eq!(sealer.open(sealed).as_deref(), Some("r"));
        assert!(!sealed.contains('r') || sealer.open(&sealed.replace('r', "s")).is_none());
        assert_eq!(
            (
                &items[1]["name"],
                &items[1]["namespace"],
                &items[1]["status"]
            ),
            (&json!("close"), &json!("agents"), &json!("incomplete"))
        );
    }

    #[test]
    fn a_call_parsed_in_one_chunk_still_gets_one_arguments_delta() {
        let mut out = Output::new("z", HashMap::new(), None);
        let c = call("f", json!({"path": "a.rs"}));
        out.push(
            vec![Part::CallStart {
                index: 0,
                id: "call_3".into(),
                name: "f".into(),
            }],
            &[("call_3".into(), c)],
        );
        let events = out.take_events();
        assert_eq!(
            kinds(&events),
            [
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(events[1]["delta"], "{\"path\":\"a.rs\"}");
        assert_eq!(events[1]["delta"], events[2]["arguments"]);
    }
}
