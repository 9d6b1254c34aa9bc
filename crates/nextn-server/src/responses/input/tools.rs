//! A Responses request's tools: function tools (and `namespace` groups of them) as the server's
//! tools, `tool_choice` checked against them. Hosted tools (`web_search`, `file_search`,
//! `code_interpreter`, `computer_use_preview`, `image_generation`, `mcp`, ...) run on OpenAI's
//! side: there is nothing here to run them, so they are left out of the prompt with a warning in
//! the log and the request goes on with its functions (Codex offers web search unless told not
//! to).

use std::collections::HashMap;

use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::tools::{self, Tool, ToolChoice};

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_field(param, message)
}

/// The request's functions, as the template shows them, by qualified name for namespaced ones,
/// and what the response repeats.
pub(super) struct Tools {
    pub tools: Vec<Tool>,
    pub for_template: Vec<Value>,
    pub namespaced: HashMap<String, (String, String)>,
    pub echo: Value,
}

/// A Responses function tool (`{"type": "function", "name", "description", "parameters",
/// "strict"}`) under `name`, and as the template shows it.
fn function(t: &Map<String, Value>, name: &str, param: &str) -> Result<(Tool, Value), ApiError> {
    let tool = tools::named_tool(Some(&json!(name)), t.get("parameters"), param, "parameters")?;
    let mut f = Map::new();
    f.insert("name".into(), json!(name));
    match t.get("description") {
        None | Some(Value::Null) => {}
        Some(d @ Value::String(_)) => {
            f.insert("description".into(), d.clone());
        }
        Some(_) => {
            return Err(bad(
                &format!("{param}.description"),
                format!("'{param}.description' must be a string"),
            ))
        }
    }
    if let Some(p) = t.get("parameters").filter(|p| !p.is_null()) {
        f.insert("parameters".into(), p.clone());
    }
    Ok((tool, json!({"type": "function", "function": f})))
}

fn tool_name<'a>(t: &'a Map<String, Value>, param: &str) -> Result<&'a str, ApiError> {
    match t.get("name") {
        Some(Value::String(n)) => Ok(n),
        _ => Err(bad(
            &format!("{param}.name"),
            format!("'{param}.name' must be a string"),
        )),
    }
}

/// Tool types the Responses API runs on its own side.
const HOSTED: &[&str] = &[
    "web_search",
    "web_search_preview",
    "web_search_2025_08_26",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "computer_use",
    "image_generation",
    "mcp",
    "local_shell",
];

pub(super) fn parse_tools(o: &Map<String, Value>) -> Result<Tools, ApiError> {
    let mut out = Tools {
        tools: Vec::new(),
        for_template: Vec::new(),
        namespaced: HashMap::new(),
        echo: json!([]),
    };
    let list = match o.get("tools").filter(|v| !v.is_null()) {
        None => return Ok(out),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad("tools", "'tools' must be an array")),
    };
    out.echo = Value::Array(list.clone());
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let Some(t) = t.as_object() else {
            return Err(bad(&param, "each tool must be an object"));
        };
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let (tool, shown) = function(t, tool_name(t, &param)?, &param)?;
                out.tools.push(tool);
                out.for_template.push(shown);
            }
            // A group of functions (`{"type": "namespace", "name", "tools": [...]}`): the model
            // sees each as `namespace.name`, and its calls carry the namespace.
            Some("namespace") => {
                let ns = tool_name(t, &param)?;
                let Some(Value::Array(inner)) = t.get("tools") else {
                    return Err(bad(
                        &format!("{param}.tools"),
                        format!("'{param}.tools' must be an array"),
                    ));
                };
                for (j, f) in inner.iter().enumerate() {
                    let fparam = format!("{param}.tools[{j}]");
                    let Some(f) = f.as_object() else {
                        return Err(bad(&fparam, "each tool must be an object"));
                    };
                    match f.get("type").and_then(Value::as_str) {
                        Some("function") => {}
                        other => {
                            return Err(bad(
                                &format!("{fparam}.type"),
                                format!(
                                    "tools of type '{}' are not supported inside a namespace (only 'function')",
                                    other.unwrap_or("(none)")
                                ),
                            ))
                        }
                    }
                    let name = tool_name(f, &fparam)?;
                    let qualified = format!("{ns}.{name}");
                    let (tool, shown) = function(f, &qualified, &fparam)?;
                    out.tools.push(tool);
                    out.for_template.push(shown);
                    out.namespaced
                        .insert(qualified, (ns.to_string(), name.to_string()));
                }
            }
            Some(kind) if HOSTED.contains(&kind) => {
                eprintln!(
                    "warning: /v1/responses: {param} is a hosted tool of type '{kind}', which this server cannot run; it is left out of the prompt"
                );
            }
            Some(other) => {
                return Err(bad(
                    &format!("{param}.type"),
                    format!("tools of type '{other}' are not supported: only 'function' (and 'namespace' groups of functions) run here"),
                ))
            }
            None => return Err(bad(&format!("{param}.type"), "each tool needs a 'type'")),
        }
    }
    tools::check_unique(&out.tools, "tools")?;
    Ok(out)
}

/// The name the model knows a called function by: `namespace.name` for a namespaced one.
pub(super) fn qualified_name(name: &str, namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) if !ns.is_empty() => format!("{ns}.{name}"),
        _ => name.to_string(),
    }
}

/// `tool_choice`, checked against the tools. A hosted tool type (`{"type": "web_search"}`) asks
/// for a tool that is not here: the model is left to choose (`auto`), with a warning.
pub(super) fn parse_tool_choice(
    o: &Map<String, Value>,
    tools: &Tools,
) -> Result<ToolChoice, ApiError> {
    let Some(v) = o.get("tool_choice").filter(|v| !v.is_null()) else {
        return Ok(ToolChoice::Auto);
    };
    let choice = match v {
        Value::String(s) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!("'tool_choice' '{other}' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"name\": ...}}"),
                ))
            }
        },
        Value::Object(m) => match m.get("type").and_then(Value::as_str) {
            Some("function") => {
                let Some(name) = m.get("name").and_then(Value::as_str) else {
                    return Err(bad(
                        "tool_choice.name",
                        "'tool_choice' of type function needs a 'name'",
                    ));
                };
                let namespace = m.get("namespace").and_then(Value::as_str);
                let mut wanted = qualified_name(name, namespace);
                let plain = tools.tools.iter().any(|t| t.name == wanted);
                if !plain && namespace.is_none() {
                    // A function's own name, when one namespace has it.
                    let mut matches = tools
                        .namespaced
                        .iter()
                        .filter(|(_, (_, n))| n == name)
                        .map(|(q, _)| q.clone());
                    if let (Some(q), None) = (matches.next(), matches.next()) {
                        wanted = q;
                    }
                }
                ToolChoice::Named(wanted)
            }
            Some(kind) if HOSTED.contains(&kind) => {
                eprintln!(
                    "warning: /v1/responses: tool_choice asks for the hosted tool '{kind}', which this server cannot run; the model chooses"
                );
                ToolChoice::Auto
            }
            Some(other) => {
                return Err(bad(
                    "tool_choice.type",
                    format!("'tool_choice' of type '{other}' is not supported: only \"none\", \"auto\", \"required\" or a function"),
                ))
            }
            None => return Err(bad("tool_choice.type", "'tool_choice' needs a 'type'")),
        },
        _ => {
            return Err(bad(
                "tool_choice",
                "'tool_choice' must be a string or an object",
            ))
        }
    };
    tools::check_choice(&choice, &tools.tools, "tool_choice")?;
    Ok(choice)
}
