//! Reading one JSON object of a request field by field, under the names its API gives the
//! fields, so that every error names the field as that API's client wrote it
//! (`messages[0].content[1].source.type`, `max_output_tokens`, `stop_sequences`).

use serde_json::{Map, Value};

use crate::error::ApiError;

/// The API's own name for each name the parsers read. A name missing from a mapped table is
/// not part of that API: the request cannot set it, only the server's default applies.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Names {
    /// The parsers' names are the API's (chat and text completions, llama-server).
    Same,
    /// `(name read, the API's name)` pairs.
    Mapped(&'static [(&'static str, &'static str)]),
}

/// An object of a request, with where it sits and the server's defaults for what it leaves out.
#[derive(Clone, Copy)]
pub(crate) struct Fields<'a> {
    obj: &'a Map<String, Value>,
    /// The object's own path ("" for the request itself).
    at: &'a str,
    names: Names,
    /// The server's values (`--temp`, `-n`, ...) for fields the request leaves out, by the name
    /// read; they were checked when the server started.
    defaults: Option<&'a Map<String, Value>>,
}

/// `at` with `name` appended (`messages[0]` + `content` = `messages[0].content`).
pub(crate) fn join(at: &str, name: &str) -> String {
    if at.is_empty() {
        name.to_string()
    } else {
        format!("{at}.{name}")
    }
}

impl<'a> Fields<'a> {
    /// The request object itself, with the API's names and the server's defaults.
    pub fn request(
        obj: &'a Map<String, Value>,
        names: Names,
        defaults: Option<&'a Map<String, Value>>,
    ) -> Self {
        Fields {
            obj,
            at: "",
            names,
            defaults,
        }
    }

    /// A nested object at `at`, read under its own names (no defaults).
    pub fn nested(obj: &'a Map<String, Value>, at: &'a str) -> Self {
        Fields {
            obj,
            at,
            names: Names::Same,
            defaults: None,
        }
    }

    /// The API's name for `name`, or `None` where the API has no such field.
    fn api_name(&self, name: &str) -> Option<&'static str> {
        match self.names {
            Names::Same => None,
            Names::Mapped(table) => table.iter().find(|(n, _)| *n == name).map(|(_, a)| *a),
        }
    }

    /// The field as the client names it.
    pub fn path(&self, name: &str) -> String {
        match self.api_name(name) {
            Some(api) => join(self.at, api),
            None => join(self.at, name),
        }
    }

    /// The request's own value of `name` (present and not null), where the API has the field.
    pub fn own(&self, name: &str) -> Option<&'a Value> {
        let key = match self.names {
            Names::Same => name,
            Names::Mapped(_) => self.api_name(name)?,
        };
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// The value of `name`: the request's, else the server's default.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.own(name).or_else(|| {
            self.defaults
                .and_then(|d| d.get(name))
                .filter(|v| !v.is_null())
        })
    }

    pub fn bad(&self, name: &str, message: impl Into<String>) -> ApiError {
        ApiError::invalid_field(&self.path(name), message)
    }

    pub fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.bad(
                    name,
                    format!("'{}' must be a finite number", self.path(name)),
                )),
            },
        }
    }

    pub fn ranged(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        match self.number(name)? {
            Some(x) if !(lo..=hi).contains(&x) => Err(self.bad(
                name,
                format!(
                    "'{}' must be between {lo} and {hi}, got {x}",
                    self.path(name)
                ),
            )),
            x => Ok(x.map(|x| x as f32)),
        }
    }

    pub fn integer(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match (v.as_i64(), v.as_u64(), v.as_f64()) {
                (Some(i), _, _) => Ok(Some(i)),
                (None, Some(_), _) => Ok(Some(i64::MAX)),
                // Clients written in JavaScript send 100.0 for 100.
                (None, None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                _ => Err(self.bad(name, format!("'{}' must be an integer", self.path(name)))),
            },
        }
    }

    pub fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.bad(name, format!("'{}' must be true or false", self.path(name)))),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.bad(name, format!("'{}' must be a string", self.path(name)))),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(_) => Err(self.bad(name, format!("'{}' must be an object", self.path(name)))),
        }
    }
}

/// Parse a request body: a JSON object, or a 400 saying what it is instead.
pub fn parse_json(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// A boolean field of a body read on its own (llama-server's endpoints); absent or `null` is
/// `default`.
pub(crate) fn flag(o: &Map<String, Value>, name: &str, default: bool) -> Result<bool, ApiError> {
    Ok(Fields::request(o, Names::Same, None)
        .boolean(name)?
        .unwrap_or(default))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn mapped_names_read_and_name_the_apis_field() {
        let o = json!({"max_output_tokens": 7, "n_predict": 3, "temperature": "hot"});
        let o = o.as_object().unwrap();
        let defaults = json!({"n_predict": 50, "top_k": 4});
        let f = Fields::request(
            o,
            Names::Mapped(&[
                ("max_tokens", "max_output_tokens"),
                ("temperature", "temperature"),
            ]),
            defaults.as_object(),
        );
        assert_eq!(f.integer("max_tokens").unwrap(), Some(7));
        // Not a field of this API: only the server's default.
        assert_eq!(f.integer("n_predict").unwrap(), Some(50));
        assert_eq!(f.integer("top_k").unwrap(), Some(4));
        assert_eq!(f.path("max_tokens"), "max_output_tokens");
        let e = f.number("temperature").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let inner = json!({"budget_tokens": "x"});
        let t = Fields::nested(inner.as_object().unwrap(), "thinking");
        let e = t.integer("budget_tokens").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("thinking.budget_tokens"));
        assert!(e
            .message
            .contains("'thinking.budget_tokens' must be an integer"));
    }
}
