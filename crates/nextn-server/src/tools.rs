//! Tool calls: the tools a request offers, the calls the model writes in its answer, and the
//! grammar that makes it write one when the request demands it.
//!
//! Qwen3.5 / Qwen3.6 (and Qwen3-Coder) write a call as
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! and Qwen3 and many fine-tunes as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
//! Both are understood in every answer; parameter values are converted to the types the tool's
//! JSON Schema declares. A call is reported once its markup is complete, so no markup ever
//! reaches the answer's text, however the text is cut into pieces; markup left unfinished when
//! generation stops is returned as text. For a stream, an XML call to an offered tool is also
//! announced as soon as its name is written, and its arguments follow as they are written (a
//! string parameter character by character, other types when their value is complete), so a
//! client sees a long argument such as a file's contents grow; the complete call then carries
//! the rest.

use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// One tool a request offers (`tools[i].function`, or a legacy `functions[i]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The JSON Schema of the arguments (`{"type": "object", "properties": ...}`).
    pub parameters: Value,
}

/// `tool_choice` (or a legacy `function_call`).
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// Tools are not offered to the model and calls are not parsed.
    None,
    /// The model may call tools.
    Auto,
    /// The model must call at least one tool (enforced by the grammar).
    Required,
    /// The model must call this tool (enforced by the grammar).
    Named(String),
}

/// How a chat template has the model write a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>`.
    Xml,
    /// `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`.
    Json,
}

impl ToolFormat {
    /// The format a template teaches: JSON inside `<tool_call>` when the template says so
    /// (Qwen3), else the XML form of Qwen3.5 / Qwen3.6.
    pub fn of_template(source: &str) -> Self {
        if !source.contains("<function=")
            && source.contains("<tool_call>")
            && source.contains("\"arguments\"")
        {
            ToolFormat::Json
        } else {
            ToolFormat::Xml
        }
    }
}

/// A call the model made.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON object.
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    /// `function.arguments`: the arguments as a JSON string.
    pub fn arguments_json(&self) -> String {
        Value::Object(self.arguments.clone()).to_string()
    }
}

fn tool_error(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_field(param, message)
}

/// A tool or function name: what templates print inside `<function=...>` and what grammars
/// write back.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
}

/// A tool named `name` (checked) whose arguments follow `parameters` (a JSON Schema object, or
/// none: no arguments); `param` is where the request gave it, `schema_key` its schema's field.
pub(crate) fn named_tool(
    name: Option<&Value>,
    parameters: Option<&Value>,
    param: &str,
    schema_key: &str,
) -> Result<Tool, ApiError> {
    let name = match name {
        Some(Value::String(n)) if valid_name(n) => n.clone(),
        Some(Value::String(n)) => {
            return Err(tool_error(
                &format!("{param}.name"),
                format!("'{param}.name' '{n}' must be 1-256 letters, digits, '_', '-', '.' or ':'"),
            ))
        }
        _ => {
            return Err(tool_error(
                &format!("{param}.name"),
                format!("'{param}.name' must be a string"),
            ))
        }
    };
    let parameters = match parameters {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(tool_error(
                &format!("{param}.{schema_key}"),
                format!("'{param}.{schema_key}' must be a JSON Schema object"),
            ))
        }
    };
    Ok(Tool { name, parameters })
}

fn function_of(f: &Value, param: &str) -> Result<Tool, ApiError> {
    let Some(f) = f.as_object() else {
        return Err(tool_error(param, format!("'{param}' must be an object")));
    };
    named_tool(f.get("name"), f.get("parameters"), param, "parameters")
}

/// Two tools of one name could not be told apart in the model's calls.
pub(crate) fn check_unique(tools: &[Tool], param: &str) -> Result<(), ApiError> {
    let mut seen = std::collections::HashSet::new();
    for t in tools {
        if !seen.insert(&t.name) {
            return Err(tool_error(
                param,
                format!("two tools are named '{}'", t.name),
            ));
        }
    }
    Ok(())
}

/// A choice that needs a tool the request does not offer is refused, naming `param`.
pub(crate) fn check_choice(
    choice: &ToolChoice,
    tools: &[Tool],
    param: &str,
) -> Result<(), ApiError> {
    match choice {
        ToolChoice::Required if tools.is_empty() => Err(tool_error(
            param,
            format!("'{param}' is \"required\" but the request offers no tools"),
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(tool_error(
            param,
            format!("'{param}' names '{n}', which is not one of the request's tools"),
        )),
        _ => Ok(()),
    }
}

/// The request's tools (`tools`, or legacy `functions`) and the array the chat template gets
/// (OpenAI's `[{"type": "function", "function": {...}}]`).
pub fn parse_tools(o: &Map<String, Value>) -> Result<(Vec<Tool>, Value), ApiError> {
    let mut tools = Vec::new();
    let mut for_template = Vec::new();
    match o.get("tools").filter(|v| !v.is_null()) {
        None => {}
        Some(Value::Array(list)) => {
            for (i, t) in list.iter().enumerate() {
                let param = format!("tools[{i}]");
                match t.get("type").and_then(Value::as_str) {
                    Some("function") => {}
                    Some(other) => {
                        return Err(tool_error(
                            &param,
                            format!("tools of type '{other}' are not supported (only 'function')"),
                        ))
                    }
                    None => {
                        return Err(tool_error(&param, "each tool needs \"type\": \"function\""))
                    }
                }
                let f = t.get("function").unwrap_or(&Value::Null);
                tools.push(function_of(f, &format!("{param}.function"))?);
                for_template.push(t.clone());
            }
        }
        Some(_) => return Err(tool_error("tools", "'tools' must be an array")),
    }
    match o.get("functions").filter(|v| !v.is_null()) {
        None => {}
        Some(Value::Array(list)) => {
            if !tools.is_empty() {
                return Err(tool_error(
                    "functions",
                    "give either 'tools' or the older 'functions', not both",
                ));
            }
            for (i, f) in list.iter().enumerate() {
                tools.push(function_of(f, &format!("functions[{i}]"))?);
                for_template.push(json!({"type": "function", "function": f}));
            }
        }
        Some(_) => return Err(tool_error("functions", "'functions' must be an array")),
    }
    check_unique(&tools, "tools")?;
    Ok((tools, Value::Array(for_template)))
}

/// `tool_choice` (or legacy `function_call`), checked against the tools.
pub fn parse_tool_choice(o: &Map<String, Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let (param, v) = match (o.get("tool_choice"), o.get("function_call")) {
        (Some(v), _) if !v.is_null() => ("tool_choice", v),
        (_, Some(v)) if !v.is_null() => ("function_call", v),
        _ => return Ok(ToolChoice::Auto),
    };
    let choice = match v {
        Value::String(s) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" | "any" if param == "tool_choice" => ToolChoice::Required,
            other => {
                return Err(tool_error(
                    param,
                    format!("'{param}' '{other}' must be \"none\", \"auto\", \"required\" or a named function"),
                ))
            }
        },
        Value::Object(m) => {
            let name = m
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| m.get("name"))
                .and_then(Value::as_str);
            match name {
                Some(n) => ToolChoice::Named(n.to_string()),
                None => {
                    return Err(tool_error(
                        param,
                        format!("'{param}' names a function as {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    ))
                }
            }
        }
        _ => {
            return Err(tool_error(
                param,
                format!("'{param}' must be a string or an object"),
            ))
        }
    };
    check_choice(&choice, tools, param)?;
    Ok(choice)
}

/// OpenAI clients send an assistant message's `function.arguments` as a JSON string; chat
/// templates iterate over them as a mapping. Decode them (a string that is not JSON stays).
pub fn arguments_for_template(tool_calls: &Value) -> Value {
    let mut calls = tool_calls.clone();
    if let Some(list) = calls.as_array_mut() {
        for call in list {
            let args = call
                .get_mut("function")
                .and_then(|f| f.get_mut("arguments"));
            if let Some(a) = args {
                if let Some(s) = a.as_str() {
                    if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                        *a = v;
                    }
                }
            }
        }
    }
    calls
}

// ---------------------------------------------------------------------------------------------
// Parsing the model's answer

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

/// What the parser found in a piece of the answer.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolEvent {
    /// Text outside any call (may still contain reasoning tags).
    Text(String),
    /// A call whose name is written and whose arguments are being written: the next
    /// [`ToolEvent::Call`] completes it.
    CallStart(String),
    /// The next piece of the started call's arguments JSON.
    ArgumentsDelta(String),
    /// A complete call. After a [`ToolEvent::CallStart`], its arguments JSON begins with the
    /// deltas sent so far.
    Call(ToolCall),
    /// The markup of a started call that generation left unfinished (text for a whole answer;
    /// a stream has shown it as the call already).
    Unfinished(String),
}

/// Splits a streamed answer into text and complete calls.
#[derive(Clone, Debug)]
pub struct ToolCallParser {
    tools: Vec<Tool>,
    /// Text not yet decided: a possible start of a call at the end, or a call in progress.
    held: String,
    /// Inside a call that started with this marker.
    open: Option<&'static str>,
    /// The call of the open block whose arguments are being streamed.
    streaming: Option<StreamedCall>,
    max_calls: Option<usize>,
    calls: usize,
}

/// The first call of an open XML block, announced and streamed while it is written. Offsets are
/// into the parser's `held` text, which begins with the block.
#[derive(Clone, Debug)]
struct StreamedCall {
    name: String,
    /// The arguments JSON sent so far.
    sent: String,
    /// Where the markup not yet turned into arguments begins.
    scan: usize,
    /// The parameter whose value is being written.
    param: Option<OpenParam>,
    /// The keys of the parameters sent so far.
    keys: Vec<String>,
    /// The markup took a form that is not streamed (arguments as one JSON object, a second
    /// function): the complete call sends the rest.
    stopped: bool,
}

#[derive(Clone, Debug)]
struct OpenParam {
    key: String,
    /// The schema makes the value a plain string, so it is sent as it is written.
    as_string: bool,
    /// Where the value's text begins.
    start: usize,
    /// Bytes of the value's text already sent.
    sent: usize,
}

impl StreamedCall {
    /// The arguments sent so far, closed as a JSON object: what the call is when its markup
    /// turns out not to parse after it was announced.
    fn closed(&self) -> Map<String, Value> {
        let mut text = self.sent.clone();
        match &self.param {
            Some(p) if p.as_string => text.push_str("\"}"),
            Some(_) => text.push_str("null}"),
            None if text.is_empty() => text.push_str("{}"),
            None => text.push('}'),
        }
        match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        }
    }
}

/// `s` as the inside of a JSON string (without the quotes). JSON escapes each character on its
/// own, so the pieces of a string escaped one by one join into the string escaped whole.
fn json_string_body(s: &str) -> String {
    let quoted = Value::String(s.to_string()).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

/// The length of the longest suffix of `text` that begins `marker` (a possible marker cut off
/// by the end of the piece).
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

impl ToolCallParser {
    /// `max_calls`: `Some(1)` with `parallel_tool_calls: false` (later calls are dropped).
    pub fn new(tools: Vec<Tool>, max_calls: Option<usize>) -> Self {
        ToolCallParser {
            tools,
            held: String::new(),
            open: None,
            streaming: None,
            max_calls,
            calls: 0,
        }
    }

    /// Add a piece of the answer; returns what is now certain.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.held.push_str(text);
        let mut events = Vec::new();
        loop {
            match self.open {
                None => {
                    let start = [CALL_OPEN, FUNCTION_OPEN]
                        .iter()
                        .filter_map(|m| self.held.find(m).map(|at| (at, *m)))
                        .min();
                    match start {
                        Some((at, marker)) => {
                            if at > 0 {
                                events.push(ToolEvent::Text(self.held[..at].to_string()));
                            }
                            self.held.drain(..at);
                            self.open = Some(marker);
                        }
                        None => {
                            let keep = partial_suffix(&self.held, CALL_OPEN)
                                .max(partial_suffix(&self.held, FUNCTION_OPEN));
                            let cut = self.held.len() - keep;
                            if cut > 0 {
                                events.push(ToolEvent::Text(self.held[..cut].to_string()));
                                self.held.drain(..cut);
                            }
                            return events;
                        }
                    }
                }
                Some(marker) => {
                    let Some(end) = self.block_end(marker) else {
                        self.stream_arguments(&mut events);
                        return events;
                    };
                    // What is written of the call's arguments goes out before the whole call.
                    self.stream_arguments(&mut events);
                    let block: String = self.held.drain(..end).collect();
                    self.open = None;
                    let streamed = self.streaming.take();
                    let mut calls = self.parse_block(&block);
                    if let Some(s) = &streamed {
                        // The announced call must stay the first call, with arguments that
                        // begin with what was sent; markup that does not parse that way ends
                        // it with the arguments sent.
                        let consistent = calls.as_ref().is_some_and(|c| {
                            c[0].name == s.name && c[0].arguments_json().starts_with(&s.sent)
                        });
                        if !consistent {
                            let first = ToolCall {
                                name: s.name.clone(),
                                arguments: s.closed(),
                            };
                            calls = Some(vec![first]);
                        }
                    }
                    match calls {
                        Some(calls) => {
                            for call in calls {
                                if self.max_calls.is_none_or(|m| self.calls < m) {
                                    events.push(ToolEvent::Call(call));
                                }
                                self.calls += 1;
                            }
                        }
                        // Not a call after all: it stays text.
                        None => events.push(ToolEvent::Text(block)),
                    }
                }
            }
        }
    }

    /// The end of the call block at the start of `held`, if it is complete.
    fn block_end(&self, marker: &str) -> Option<usize> {
        if marker == CALL_OPEN {
            return self.held.find(CALL_CLOSE).map(|at| at + CALL_CLOSE.len());
        }
        // A bare `<function=...>` block ends at `</function>`, with a `</tool_call>` after it
        // (whitespace between) taken along when it is there.
        let at = self.held.find(FUNCTION_CLOSE)? + FUNCTION_CLOSE.len();
        let rest = &self.held[at..];
        let trimmed = rest.trim_start();
        if trimmed.starts_with(CALL_CLOSE) {
            return Some(at + (rest.len() - trimmed.len()) + CALL_CLOSE.len());
        }
        // Wait until it is clear whether a `</tool_call>` follows.
        if trimmed.is_empty() || CALL_CLOSE.starts_with(trimmed) {
            return None;
        }
        Some(at)
    }

    /// What remains at the end of generation: unfinished markup comes back as text. Returns the
    /// events and whether a call was left unfinished.
    pub fn finish(&mut self) -> (Vec<ToolEvent>, bool) {
        let unfinished = self.open.is_some();
        self.open = None;
        let started = self.streaming.take().is_some();
        let rest = std::mem::take(&mut self.held);
        let events = if rest.is_empty() {
            Vec::new()
        } else if started {
            vec![ToolEvent::Unfinished(rest)]
        } else {
            vec![ToolEvent::Text(rest)]
        };
        (events, unfinished)
    }

    /// Announce the open block's call once its name is written, then send what is certain of
    /// its arguments: a parameter's key when its value begins, a string value as it is written
    /// (holding back what may be the newline and tag that close it), another value when it is
    /// complete.
    fn stream_arguments(&mut self, events: &mut Vec<ToolEvent>) {
        if self.streaming.is_none() && !self.start_stream(events) {
            return;
        }
        let Some(mut s) = self.streaming.take() else {
            return;
        };
        while !s.stopped {
            let rest = &self.held[s.scan..];
            match &mut s.param {
                None => {
                    let trimmed = rest.trim_start();
                    let at = s.scan + (rest.len() - trimmed.len());
                    if let Some(p) = trimmed.strip_prefix(PARAM_OPEN) {
                        let Some(name_end) = p.find('>') else {
                            break;
                        };
                        // The value begins after the tag's newline: wait to see it.
                        let after = &p[name_end + 1..];
                        if after.is_empty() {
                            break;
                        }
                        let key = p[..name_end].trim().to_string();
                        if s.keys.contains(&key) {
                            // A repeated parameter replaces the earlier value in the whole
                            // call; the stream ends before it.
                            s.stopped = true;
                            break;
                        }
                        let as_string = schema_types(self.schema_of(&s.name, &key)) == ["string"];
                        let mut start = at + PARAM_OPEN.len() + name_end + 1;
                        if after.starts_with('\n') {
                            start += 1;
                        }
                        let mut piece = String::from(if s.keys.is_empty() { "{" } else { "," });
                        piece.push_str(&Value::String(key.clone()).to_string());
                        piece.push(':');
                        if as_string {
                            piece.push('"');
                        }
                        s.sent.push_str(&piece);
                        events.push(ToolEvent::ArgumentsDelta(piece));
                        s.param = Some(OpenParam {
                            key,
                            as_string,
                            start,
                            sent: 0,
                        });
                        s.scan = start;
                    } else if trimmed.is_empty()
                        || PARAM_OPEN.starts_with(trimmed)
                        || trimmed.starts_with(FUNCTION_CLOSE)
                        || FUNCTION_CLOSE.starts_with(trimmed)
                    {
                        // More parameters may follow, or the call ends (the complete call
                        // closes the object).
                        break;
                    } else {
                        s.stopped = true;
                    }
                }
                Some(param) => {
                    let value = &self.held[param.start..];
                    match value.find(PARAM_CLOSE) {
                        Some(close) => {
                            let raw = &value[..close];
                            let raw = raw.strip_suffix('\n').unwrap_or(raw);
                            let piece = if param.as_string {
                                let mut piece = json_string_body(&raw[param.sent..]);
                                piece.push('"');
                                piece
                            } else {
                                typed_value(raw, self.schema_of(&s.name, &param.key)).to_string()
                            };
                            s.sent.push_str(&piece);
                            events.push(ToolEvent::ArgumentsDelta(piece));
                            s.scan = param.start + close + PARAM_CLOSE.len();
                            s.keys.push(std::mem::take(&mut param.key));
                            s.param = None;
                        }
                        None => {
                            if param.as_string {
                                let keep = partial_suffix(value, "\n</parameter>")
                                    .max(partial_suffix(value, PARAM_CLOSE));
                                let ready = value.len() - keep;
                                if ready > param.sent {
                                    let piece = json_string_body(&value[param.sent..ready]);
                                    param.sent = ready;
                                    s.sent.push_str(&piece);
                                    events.push(ToolEvent::ArgumentsDelta(piece));
                                }
                            }
                            break;
                        }
                    }
                }
            }
        }
        self.streaming = Some(s);
    }

    /// Announce the open block's call when it is an XML call to an offered tool whose name is
    /// complete (and another call is allowed). Returns whether it was announced.
    fn start_stream(&mut self, events: &mut Vec<ToolEvent>) -> bool {
        let body = self.held.strip_prefix(CALL_OPEN).unwrap_or(&self.held);
        let trimmed = body.trim_start();
        let Some(after) = trimmed.strip_prefix(FUNCTION_OPEN) else {
            return false;
        };
        let Some(name_end) = after.find('>') else {
            return false;
        };
        let name = after[..name_end].trim();
        if !self.tools.iter().any(|t| t.name == name)
            || self.max_calls.is_some_and(|m| self.calls >= m)
        {
            return false;
        }
        let scan = self.held.len() - after.len() + name_end + 1;
        events.push(ToolEvent::CallStart(name.to_string()));
        self.streaming = Some(StreamedCall {
            name: name.to_string(),
            sent: String::new(),
            scan,
            param: None,
            keys: Vec::new(),
            stopped: false,
        });
        true
    }

    /// Calls parsed so far (including those beyond `max_calls`).
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn schema_of(&self, function: &str, param: &str) -> Option<&Value> {
        self.tools
            .iter()
            .find(|t| t.name == function)
            .and_then(|t| t.parameters.get("properties"))
            .and_then(|p| p.get(param))
    }

    /// The calls in one `<tool_call>…</tool_call>` (or bare `<function=…>…</function>`)
    /// block; `None` when it is not well formed.
    fn parse_block(&self, block: &str) -> Option<Vec<ToolCall>> {
        let inner = block
            .strip_prefix(CALL_OPEN)
            .map(|b| b.strip_suffix(CALL_CLOSE).unwrap_or(b))
            .unwrap_or(block)
            .trim();
        if inner.starts_with('{') {
            return self.parse_json_call(inner).map(|c| vec![c]);
        }
        let mut calls = Vec::new();
        let mut rest = inner;
        while !rest.is_empty() {
            let body = rest.strip_prefix(FUNCTION_OPEN)?;
            let name_end = body.find('>')?;
            let name = body[..name_end].trim();
            if !valid_name(name) {
                return None;
            }
            let body = &body[name_end + 1..];
            let close = body.find(FUNCTION_CLOSE);
            let (params, after) = match close {
                Some(at) => (&body[..at], &body[at + FUNCTION_CLOSE.len()..]),
                None => (body, ""),
            };
            calls.push(ToolCall {
                name: name.to_string(),
                arguments: self.parse_parameters(name, params)?,
            });
            rest = after.trim_start();
            rest = rest.strip_prefix(CALL_CLOSE).unwrap_or(rest).trim_start();
            rest = rest.strip_prefix(CALL_OPEN).unwrap_or(rest).trim_start();
        }
        (!calls.is_empty()).then_some(calls)
    }

    fn parse_parameters(&self, function: &str, body: &str) -> Option<Map<String, Value>> {
        let mut args = Map::new();
        let mut rest = body.trim();
        if !rest.starts_with(PARAM_OPEN) {
            // Arguments written as one JSON object inside the function block, or none.
            return match rest {
                "" => Some(args),
                text => match serde_json::from_str::<Value>(text) {
                    Ok(Value::Object(m)) => Some(m),
                    _ => None,
                },
            };
        }
        while let Some(p) = rest.strip_prefix(PARAM_OPEN) {
            let name_end = p.find('>')?;
            let name = p[..name_end].trim().to_string();
            let value_and_rest = &p[name_end + 1..];
            let value_end = value_and_rest.find(PARAM_CLOSE)?;
            let raw = &value_and_rest[..value_end];
            // The format puts the value on lines of its own.
            let raw = raw.strip_prefix('\n').unwrap_or(raw);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            let value = typed_value(raw, self.schema_of(function, &name));
            args.insert(name, value);
            rest = value_and_rest[value_end + PARAM_CLOSE.len()..].trim_start();
        }
        rest.is_empty().then_some(args)
    }

    fn parse_json_call(&self, text: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(text).ok()?;
        let name = v.get("name")?.as_str()?;
        if !valid_name(name) {
            return None;
        }
        let args = v.get("arguments").or_else(|| v.get("parameters"));
        let arguments = match args {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            // Some models write the arguments as a JSON string.
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(m)) => m,
                _ => return None,
            },
            Some(_) => return None,
        };
        Some(ToolCall {
            name: name.to_string(),
            arguments,
        })
    }
}

/// The JSON types a schema allows, in the order a value's text is tried against them.
fn schema_types(schema: Option<&Value>) -> Vec<&str> {
    let Some(s) = schema else {
        return Vec::new();
    };
    let mut types: Vec<&str> = match s.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) = s.get(key) {
            for b in branches {
                types.extend(schema_types(Some(b)));
            }
        }
    }
    if types.is_empty() {
        for v in s
            .get("enum")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .chain(s.get("const"))
        {
            types.push(match v {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
                Value::Number(_) => "number",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            });
        }
    }
    types
}

/// A parameter's text as the type its schema declares: numbers, booleans, null, objects and
/// arrays are decoded; a string type keeps the text. Without a schema, JSON values are decoded
/// and anything else stays text.
pub fn typed_value(raw: &str, schema: Option<&Value>) -> Value {
    let types = schema_types(schema);
    let text = raw.trim();
    let as_json = || serde_json::from_str::<Value>(text).ok();
    if types.is_empty() {
        return match as_json() {
            Some(v) if !v.is_string() => v,
            _ => Value::String(raw.to_string()),
        };
    }
    // Non-string types first: "12" for ["integer", "string"] is the number.
    for t in types.iter().filter(|&&t| t != "string") {
        let v = match *t {
            "null" if matches!(text, "null" | "None") => Some(Value::Null),
            "boolean" => match text.to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "integer" => text.parse::<i64>().ok().map(Value::from).or_else(|| {
                // 3.0 is an integer too.
                text.parse::<f64>()
                    .ok()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                    .map(|f| Value::from(f as i64))
            }),
            "number" => as_json().filter(Value::is_number),
            "object" => as_json().filter(Value::is_object),
            "array" => as_json().filter(Value::is_array),
            _ => None,
        };
        if let Some(v) = v {
            return v;
        }
    }
    Value::String(raw.to_string())
}

// ---------------------------------------------------------------------------------------------
// The grammar that makes the model call a tool

/// A Lark string literal (JSON syntax).
fn lit(s: &str) -> String {
    Value::String(s.to_string())
        .to_string()
        .replace('\u{7f}', "\\u007f")
}

/// The grammar rule for one parameter's value in the XML format, as the schema declares it,
/// with the `\n</parameter>` that closes it.
fn xml_value(schema: &Value, rule: &str, rules: &mut Vec<String>) {
    let close = lit("\n</parameter>");
    let types = schema_types(Some(schema));
    let choices: Option<Vec<String>> = schema
        .get("enum")
        .and_then(Value::as_array)
        .map(|vs| vs.to_vec())
        .or_else(|| schema.get("const").map(|c| vec![c.clone()]))
        .map(|vs| {
            vs.iter()
                .map(|v| match v {
                    Value::String(s) => lit(s),
                    other => lit(&other.to_string()),
                })
                .collect()
        });
    let body = match (choices, types.as_slice()) {
        (Some(c), _) => format!("({})", c.join(" | ")),
        // Any text, up to the first closing tag.
        (None, [] | ["string"]) => {
            rules.push(format!("{rule}[lazy]: /(.|\\n)*\\n<\\/parameter>/"));
            return;
        }
        (None, ["integer"]) => "/-?(0|[1-9][0-9]*)/".to_string(),
        (None, ["boolean"]) => "(\"true\" | \"false\")".to_string(),
        (None, ["null"]) => "\"null\"".to_string(),
        (None, _) => format!("%json {schema}"),
    };
    rules.push(format!("{rule}: {body} {close}"));
}

/// Lark rules for a call of one tool, named `call_<i>`.
fn call_rules(tool: &Tool, i: usize, format: ToolFormat, rules: &mut Vec<String>) {
    let rule = format!("call_{i}");
    match format {
        ToolFormat::Json => {
            // Only the declared parameters, as in the XML form.
            let mut arguments = tool.parameters.clone();
            if let Some(a) = arguments.as_object_mut() {
                a.entry("additionalProperties").or_insert(json!(false));
            }
            let schema = json!({
                "type": "object",
                "properties": {
                    "name": {"const": tool.name},
                    "arguments": arguments,
                },
                "required": ["name", "arguments"],
                "additionalProperties": false,
            });
            rules.push(format!(
                "{rule}: {} %json {schema} {}",
                lit("<tool_call>\n"),
                lit("\n</tool_call>")
            ));
        }
        ToolFormat::Xml => {
            let props = tool
                .parameters
                .get("properties")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            let required: Vec<&str> = tool
                .parameters
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut parts = vec![lit(&format!("<tool_call>\n<function={}>\n", tool.name))];
            for (j, (name, schema)) in props.iter().enumerate() {
                let value = format!("v_{i}_{j}");
                xml_value(schema, &value, rules);
                let param = format!(
                    "{} {value} {}",
                    lit(&format!("<parameter={name}>\n")),
                    lit("\n")
                );
                if required.contains(&name.as_str()) {
                    parts.push(param);
                } else {
                    parts.push(format!("({param})?"));
                }
            }
            parts.push(lit("</function>\n</tool_call>"));
            rules.push(format!("{rule}: {}", parts.join(" ")));
        }
    }
}

/// How a model may reason before the call a grammar forces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reasoning {
    /// The template has no reasoning block: the call comes at once.
    None,
    /// The model may open a `<think>` block first.
    Optional,
    /// The prompt has already opened a `<think>` block: its rest comes first.
    Open,
}

/// The Lark grammar for `tool_choice` `required` (any of `tools`) or a named tool: the
/// reasoning `reasoning` allows, then one call, or several with `parallel`.
pub fn call_grammar(
    tools: &[Tool],
    only: Option<&str>,
    format: ToolFormat,
    parallel: bool,
    reasoning: Reasoning,
) -> String {
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        if only.is_some_and(|n| n != t.name) {
            continue;
        }
        call_rules(t, i, format, &mut rules);
        alternatives.push(format!("call_{i}"));
    }
    let calls = if parallel {
        "call (\"\\n\" call)*"
    } else {
        "call"
    };
    let reasoning = match reasoning {
        Reasoning::None => "",
        Reasoning::Optional => "(\"<think>\" think_rest /\\n*/)? ",
        Reasoning::Open => "think_rest /\\n*/ ",
    };
    let mut out = format!("start: {reasoning}{calls}\n");
    out.push_str("think_rest[lazy]: /(.|\\n)*<\\/think>/\n");
    out.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    for r in rules {
        out.push_str(&r);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests;

/// A complete call of `name` with the arguments object `args`, for tests of what answers carry.
#[cfg(test)]
pub(crate) fn test_call(name: &str, args: Value) -> ToolCall {
    let Value::Object(arguments) = args else {
        panic!("a call's arguments are an object, not {args}")
    };
    ToolCall {
        name: name.into(),
        arguments,
    }
}
