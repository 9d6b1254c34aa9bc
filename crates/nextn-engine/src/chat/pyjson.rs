//! `tojson` as chat templates expect it: Python's `json.dumps(x, ensure_ascii=False)`.
//!
//! Templates are written against Hugging Face's Jinja environment, whose `tojson` is `json.dumps`
//! with `", "` / `": "` separators, insertion-ordered keys, non-ASCII kept as is and no HTML
//! escaping (minijinja's own `tojson` is compact and HTML-escapes, which changes the prompt).

use serde_json::Value;

/// Formatting options of `json.dumps` (defaults: compact, non-ASCII kept, keys in order).
#[derive(Debug, Clone, Default)]
pub(crate) struct DumpOptions {
    /// Pretty-print with this string per level (Python: an int n means n spaces).
    pub indent: Option<String>,
    pub ensure_ascii: bool,
    pub sort_keys: bool,
    /// (item separator, key separator); Python's default depends on `indent`.
    pub separators: Option<(String, String)>,
}

pub(crate) fn dumps(value: &Value, options: &DumpOptions) -> String {
    let (item_sep, key_sep) = match &options.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None if options.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut out = String::new();
    let writer = Writer {
        options,
        item_sep,
        key_sep,
    };
    writer.value(value, 0, &mut out);
    out
}

struct Writer<'o> {
    options: &'o DumpOptions,
    item_sep: &'o str,
    key_sep: &'o str,
}

impl Writer<'_> {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.options.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn value(&self, value: &Value, depth: usize, out: &mut String) {
        match value {
            Value::Null => out.push_str("null"),
            Value::Bool(true) => out.push_str("true"),
            Value::Bool(false) => out.push_str("false"),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    out.push_str(&i.to_string());
                } else if let Some(u) = n.as_u64() {
                    out.push_str(&u.to_string());
                } else if let Some(f) = n.as_f64() {
                    out.push_str(&python_float_repr(f));
                }
            }
            Value::String(s) => self.string(s, out),
            Value::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.value(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            Value::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                if self.options.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.string(key, out);
                    out.push_str(self.key_sep);
                    self.value(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0C}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.options.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents -4..16, else
/// scientific with a signed two-digit exponent; integral values keep a ".0".
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // `{:e}` prints the shortest round-trip digits: "1.2345e3", "-5e-7".
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{body}")
    } else {
        let mantissa = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_print_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e-6, "1e-06"),
            (0.0001, "0.0001"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (123456.789, "123456.789"),
            (-0.0, "-0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_like_json_dumps() {
        let v = json!({"name": "get_weather", "parameters": {"type": "object", "required": ["city"], "x": [], "y": {}},
                       "s": "é\"\n<b>&", "n": 3, "f": 0.5, "t": true, "z": null});
        assert_eq!(
            dumps(&v, &DumpOptions::default()),
            r#"{"name": "get_weather", "parameters": {"type": "object", "required": ["city"], "x": [], "y": {}}, "s": "é\"\n<b>&", "n": 3, "f": 0.5, "t": true, "z": null}"#
        );
        let pretty = DumpOptions {
            indent: Some("  ".into()),
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&json!({"a": [1, 2], "b": {}}), &pretty),
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": {}\n}"
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&json!({"b": "é😀", "a": 1}), &ascii),
            r#"{"a": 1, "b": "\u00e9\ud83d\ude00"}"#
        );
    }
}
