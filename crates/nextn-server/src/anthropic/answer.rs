//! The answer to a Messages request: the parts of the generated text (thinking, text, tool
//! calls) as Anthropic's content blocks in the order they were generated, whole or as Anthropic's
//! stream events, with a `ping` whenever the stream has been quiet for a while.

use std::collections::VecDeque;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::Response;
use nextn_engine::scheduler::{Completion, Event};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error_body;
use crate::error::ApiError;
use crate::respond::{collect_events, failure, sse_response, started, Part, Reply};
use crate::tools::ToolCall;

/// Anthropic's keep-alive event, sent when a stream opens and whenever it has been quiet for
/// `respond::IDLE_FRAME_AFTER` (a thinking phase with `display: "omitted"` sends nothing else).
pub(crate) fn ping_frame() -> Bytes {
    event("ping", &json!({"type": "ping"}))
}

pub(crate) struct Answer {
    pub reply: Reply,
    pub tokenizer: std::sync::Arc<nextn_engine::tokenizer::Tokenizer>,
    pub id: String,
    pub model: String,
    pub show_thinking: bool,
    pub stop_sequences: Vec<String>,
    pub prompt_tokens: usize,
}

/// Anthropic's tool-use ids: the chat path's call id with Anthropic's prefix.
pub(crate) fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// A thinking block's `signature`: Anthropic's is an opaque check that the block came from the
/// model unchanged; here it is a digest of the block's text (64-bit FNV-1a, hex), which clients
/// only send back.
#[derive(Clone, Copy)]
pub(crate) struct Signature(pub(crate) u64);

impl Signature {
    pub(crate) fn new() -> Self {
        Signature(0xcbf2_9ce4_8422_2325)
    }
    pub(crate) fn add(&mut self, text: &str) {
        for b in text.bytes() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub(crate) fn text(self) -> String {
        format!("nextn-fnv1a64:{:016x}", self.0)
    }
}

fn usage(c: &Completion) -> Value {
    let cached = c.timings.cache_n.min(c.prompt_tokens);
    json!({
        "input_tokens": c.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": c.completion_tokens,
    })
}

impl Answer {
    /// `stop_reason` and `stop_sequence`. A stop sequence is told from an end-of-generation
    /// token by finding it in the output's text (the stop matcher ends at its first occurrence).
    fn stop(&self, c: &Completion) -> (&'static str, Value) {
        match self.reply.finish_reason(c) {
            "tool_calls" => ("tool_use", Value::Null),
            "length" => ("max_tokens", Value::Null),
            _ => {
                let text = self.tokenizer.decode(&c.tokens);
                let hit = self
                    .stop_sequences
                    .iter()
                    .filter(|s| !s.is_empty())
                    .filter_map(|s| text.find(s.as_str()).map(|at| (at, s)))
                    .min_by_key(|(at, _)| *at);
                match hit {
                    Some((_, s)) => ("stop_sequence", json!(s)),
                    None => ("end_turn", Value::Null),
                }
            }
        }
    }

    fn message(&self, content: Vec<Value>, stop: (&str, Value), usage: Value) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop.0,
            "stop_sequence": stop.1,
            "usage": usage,
        })
    }
}

/// A content block of a whole answer, while its text grows.
enum Block {
    Thinking(String),
    Text(String),
    ToolUse(Value),
}

/// The content blocks of a whole answer from its parts, in the order they were generated: runs
/// of reasoning and of text are one block each, a call's block stands where the model began
/// writing it (a call whose markup was cut off came back as text and has no block). Thinking
/// blocks carry the digest of all the reasoning as their signature; their text is empty when it
/// is not shown.
fn content_blocks(
    parts: Vec<Part>,
    calls: &[(String, ToolCall)],
    show_thinking: bool,
) -> Vec<Value> {
    let mut blocks: Vec<Block> = Vec::new();
    let mut signature = Signature::new();
    for p in parts {
        match (p, blocks.last_mut()) {
            (Part::Reasoning(r), last) => {
                signature.add(&r);
                let shown = if show_thinking { r } else { String::new() };
                match last {
                    Some(Block::Thinking(t)) => t.push_str(&shown),
                    _ => blocks.push(Block::Thinking(shown)),
                }
            }
            (Part::Content(c), Some(Block::Text(t))) => t.push_str(&c),
            (Part::Content(c), _) => blocks.push(Block::Text(c)),
            (Part::CallStart { index, .. }, _) => {
                if let Some((id, call)) = calls.get(index) {
                    blocks.push(Block::ToolUse(json!({
                        "type": "tool_use",
                        "id": tool_use_id(id),
                        "name": call.name,
                        "input": Value::Object(call.arguments.clone()),
                    })));
                }
            }
            (Part::CallArguments { .. }, _) => {}
        }
    }
    let signature = signature.text();
    blocks
        .into_iter()
        .map(|b| match b {
            Block::Thinking(t) => {
                json!({"type": "thinking", "thinking": t, "signature": signature})
            }
            Block::Text(t) => json!({"type": "text", "text": t}),
            Block::ToolUse(v) => v,
        })
        .collect()
}

pub(crate) async fn collect(
    mut rx: UnboundedReceiver<Event>,
    mut a: Answer,
) -> Result<Response, ApiError> {
    let mut parts = Vec::new();
    let completion =
        collect_events(&mut rx, |t| parts.extend(a.reply.parts(t)), &mut Vec::new()).await?;
    parts.extend(a.reply.finish_parts());
    a.reply.log(&completion);
    let content = content_blocks(parts, a.reply.calls(), a.show_thinking);
    let stop = a.stop(&completion);
    let body = a.message(content, stop, usage(&completion));
    Ok(crate::handler::json_response(StatusCode::OK, body))
}

fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The content block a stream has open.
enum Open {
    Thinking(Signature),
    Text,
    /// A tool_use block, for the call with this index.
    Tool(usize),
}

crate::respond::sse_frames!(StreamState);

struct StreamState {
    rx: UnboundedReceiver<Event>,
    answer: Answer,
    frames: VecDeque<Bytes>,
    started: bool,
    /// Index of the next content block.
    next_block: usize,
    open: Option<Open>,
    finished: bool,
}

impl StreamState {
    fn idle_frame() -> Bytes {
        ping_frame()
    }

    fn push(&mut self, name: &str, data: Value) {
        self.frames.push_back(event(name, &data));
    }

    /// `message_start` and a `ping`, once: the usage so far (the prompt, its prefix-cache hit).
    fn start(&mut self, cached: usize) {
        if self.started {
            return;
        }
        self.started = true;
        let cached = cached.min(self.answer.prompt_tokens);
        let mut m = self.answer.message(
            Vec::new(),
            ("", Value::Null),
            json!({
                "input_tokens": self.answer.prompt_tokens - cached,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": 0,
            }),
        );
        m["stop_reason"] = Value::Null;
        self.push(
            "message_start",
            json!({"type": "message_start", "message": m}),
        );
        self.push("ping", json!({"type": "ping"}));
    }

    fn close_block(&mut self) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.next_block - 1;
        if let Open::Thinking(sig) = open {
            self.push(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "signature_delta", "signature": sig.text()}}),
            );
        }
        self.push(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        );
    }

    fn open_block(&mut self, open: Open, block: Value) {
        self.close_block();
        let index = self.next_block;
        self.next_block += 1;
        self.open = Some(open);
        self.push(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        );
    }

    fn delta(&mut self, delta: Value) {
        let index = self.next_block - 1;
        self.push(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }

    fn parts(&mut self, parts: Vec<Part>) {
        for p in parts {
            match p {
                Part::Reasoning(r) => {
                    if !matches!(self.open, Some(Open::Thinking(_))) {
                        self.open_block(
                            Open::Thinking(Signature::new()),
                            json!({"type": "thinking", "thinking": "", "signature": ""}),
                        );
                    }
                    if let Some(Open::Thinking(sig)) = &mut self.open {
                        sig.add(&r);
                    }
                    if self.answer.show_thinking {
                        self.delta(json!({"type": "thinking_delta", "thinking": r}));
                    }
                }
                Part::Content(c) => {
                    if !matches!(self.open, Some(Open::Text)) {
                        self.open_block(Open::Text, json!({"type": "text", "text": ""}));
                    }
                    self.delta(json!({"type": "text_delta", "text": c}));
                }
                Part::CallStart { index, id, name } => self.open_block(
                    Open::Tool(index),
                    json!({"type": "tool_use", "id": tool_use_id(&id), "name": name, "input": {}}),
                ),
                Part::CallArguments { index, text } => {
                    if matches!(self.open, Some(Open::Tool(i)) if i == index) {
                        self.delta(json!({"type": "input_json_delta", "partial_json": text}));
                    }
                }
            }
        }
    }

    fn on_event(&mut self, ev: Option<Event>) {
        match ev {
            Some(Event::PromptProgress { cache, .. }) => self.start(cache),
            Some(Event::Text(t)) => {
                self.start(0);
                let parts = self.answer.reply.parts(&t);
                self.parts(parts);
            }
            Some(Event::Done(c)) => {
                self.start(c.timings.cache_n);
                let parts = self.answer.reply.finish_parts();
                self.parts(parts);
                self.close_block();
                self.answer.reply.log(&c);
                let (reason, seq) = self.answer.stop(&c);
                self.push(
                    "message_delta",
                    json!({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": usage(&c)}),
                );
                self.push("message_stop", json!({"type": "message_stop"}));
                self.finished = true;
            }
            Some(Event::Failed { kind, message }) => self.fail(&failure(kind, message)),
            Some(Event::Started { .. } | Event::Logprobs(_)) => {}
            None => self.fail(&ApiError::internal(
                "the engine stopped before the request finished",
            )),
        }
    }

    fn fail(&mut self, e: &ApiError) {
        let mut body = error_body(e);
        if let Value::Object(m) = &mut body {
            m.remove("request_id");
        }
        self.push("error", body);
        self.finished = true;
    }
}

pub(crate) async fn stream(
    mut rx: UnboundedReceiver<Event>,
    mut answer: Answer,
) -> Result<Response, ApiError> {
    started(&mut rx).await?;
    answer.reply.set_streaming();
    let state = StreamState {
        rx,
        answer,
        frames: VecDeque::new(),
        started: false,
        next_block: 0,
        open: None,
        finished: false,
    };
    Ok(sse_response(state))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tools::test_call as call;

    /// Text after a call stays after it: the blocks are in the order the model wrote them, as a
    /// stream sends them.
    #[test]
    fn blocks_come_in_generation_order() {
        let calls = vec![
            ("call_a".to_string(), call("read", json!({"path": "a"}))),
            ("call_b".to_string(), call("read", json!({"path": "b"}))),
        ];
        let start = |index: usize| Part::CallStart {
            index,
            id: calls[index].0.clone(),
            name: "read".into(),
        };
        let parts = vec![
            Part::Reasoning("plan".into()),
            Part::Reasoning(" more".into()),
            Part::Content("First ".into()),
            Part::Content("a.".into()),
            start(0),
            Part::CallArguments {
                index: 0,
                text: "{}".into(),
            },
            Part::Content("Then b.".into()),
            start(1),
        ];
        let blocks = content_blocks(parts.clone(), &calls, true);
        let kinds: Vec<&str> = blocks.iter().map(|b| b["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["thinking", "text", "tool_use", "text", "tool_use"]);
        assert_eq!(blocks[0]["thinking"], "plan more");
        assert_eq!(blocks[1]["text"], "First a.");
        assert_eq!(blocks[2]["id"], "toolu_a");
        assert_eq!(blocks[2]["input"], json!({"path": "a"}));
        assert_eq!(blocks[3]["text"], "Then b.");
        assert_eq!(blocks[4]["input"], json!({"path": "b"}));
        let mut digest = Signature::new();
        digest.add("plan more");
        assert_eq!(blocks[0]["signature"], digest.text());
        // Hidden thinking keeps its block and signature, without its text.
        let hidden = content_blocks(parts, &calls, false);
        assert_eq!(hidden[0]["thinking"], "");
        assert_eq!(hidden[0]["signature"], digest.text());
    }
}
