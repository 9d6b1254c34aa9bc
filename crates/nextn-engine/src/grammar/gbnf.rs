//! llama.cpp's GBNF grammars, rewritten as the Lark-style grammars llguidance compiles.
//!
//! GBNF: `name ::= alternatives`, one rule after another; `root` is where output starts.
//! Elements are `"literals"` (with `\n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH` escapes),
//! `[character classes]` (ranges, `^` to negate, the same escapes), `.` (any character), rule
//! names, `( groups )`, the repetitions `* + ?` and `{m}`, `{m,}`, `{m,n}`, and `|` between
//! alternatives; `#` starts a comment.

use std::collections::HashMap;
use std::fmt::Write as _;

/// What is wrong with a GBNF grammar, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GBNF grammar, line {line}: {message}")]
pub struct GbnfError {
    pub line: usize,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Literal(String),
    /// `(negated, [(first, last)])`.
    Class(bool, Vec<(char, char)>),
    Any,
    Rule(String),
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    Repeat(Box<Node>, u32, Option<u32>),
}

struct Parser<'a> {
    src: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn error(&self, message: impl Into<String>) -> GbnfError {
        GbnfError {
            line: self.src[..self.pos.min(self.src.len())]
                .matches('\n')
                .count()
                + 1,
            message: message.into(),
        }
    }

    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    /// Skip spaces, newlines and comments.
    fn skip_space(&mut self) {
        while let Some(c) = self.peek() {
            if c == '#' {
                while let Some(c) = self.bump() {
                    if c == '\n' {
                        break;
                    }
                }
            } else if c.is_whitespace() {
                self.bump();
            } else {
                break;
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                self.bump();
            } else {
                break;
            }
        }
        (self.pos > start).then(|| self.src[start..self.pos].to_string())
    }

    /// Whether a rule definition (`name ::=`) starts here.
    fn at_definition(&self) -> bool {
        let mut probe = Parser {
            src: self.src,
            pos: self.pos,
        };
        if probe.name().is_none() {
            return false;
        }
        probe.skip_space();
        probe.src[probe.pos..].starts_with("::=")
    }

    fn grammar(&mut self) -> Result<Vec<(String, Node)>, GbnfError> {
        let mut rules = Vec::new();
        loop {
            self.skip_space();
            if self.peek().is_none() {
                return Ok(rules);
            }
            let Some(name) = self.name() else {
                return Err(self.error("expected a rule name"));
            };
            self.skip_space();
            if !self.src[self.pos..].starts_with("::=") {
                return Err(self.error(format!("expected '::=' after rule name '{name}'")));
            }
            self.pos += 3;
            let body = self.alternatives(false)?;
            rules.push((name, body));
        }
    }

    fn alternatives(&mut self, nested: bool) -> Result<Node, GbnfError> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.bump();
            alts.push(self.sequence(nested)?);
        }
        Ok(if alts.len() == 1 {
            alts.remove(0)
        } else {
            Node::Alt(alts)
        })
    }

    fn sequence(&mut self, nested: bool) -> Result<Node, GbnfError> {
        let mut items = Vec::new();
        loop {
            self.skip_space();
            let Some(c) = self.peek() else { break };
            if c == '|' || (nested && c == ')') || (!nested && self.at_definition()) {
                break;
            }
            let atom = match c {
                '"' => Node::Literal(self.literal()?),
                '[' => self.class()?,
                '.' => {
                    self.bump();
                    Node::Any
                }
                '(' => {
                    self.bump();
                    let inner = self.alternatives(true)?;
                    self.skip_space();
                    if self.bump() != Some(')') {
                        return Err(self.error("expected ')'"));
                    }
                    inner
                }
                ')' => return Err(self.error("unbalanced ')'")),
                _ => match self.name() {
                    Some(n) => Node::Rule(n),
                    None => return Err(self.error(format!("unexpected character '{c}'"))),
                },
            };
            items.push(self.repetition(atom)?);
        }
        Ok(if items.len() == 1 {
            items.remove(0)
        } else {
            Node::Seq(items)
        })
    }

    fn repetition(&mut self, mut atom: Node) -> Result<Node, GbnfError> {
        loop {
            match self.peek() {
                Some('*') => {
                    self.bump();
                    atom = Node::Repeat(Box::new(atom), 0, None);
                }
                Some('+') => {
                    self.bump();
                    atom = Node::Repeat(Box::new(atom), 1, None);
                }
                Some('?') => {
                    self.bump();
                    atom = Node::Repeat(Box::new(atom), 0, Some(1));
                }
                Some('{') => {
                    self.bump();
                    let (lo, hi) = self.bounds()?;
                    atom = Node::Repeat(Box::new(atom), lo, hi);
                }
                _ => return Ok(atom),
            }
        }
    }

    /// `m}`, `m,}` or `m,n}` after a `{`.
    fn bounds(&mut self) -> Result<(u32, Option<u32>), GbnfError> {
        let number = |p: &mut Self| -> Option<u32> {
            let start = p.pos;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.bump();
            }
            p.src[start..p.pos].parse().ok()
        };
        self.skip_space();
        let Some(lo) = number(self) else {
            return Err(self.error("expected a number in '{m,n}'"));
        };
        self.skip_space();
        let hi = match self.bump() {
            Some('}') => return Ok((lo, Some(lo))),
            Some(',') => {
                self.skip_space();
                let hi = number(self);
                self.skip_space();
                if self.bump() != Some('}') {
                    return Err(self.error("expected '}'"));
                }
                hi
            }
            _ => return Err(self.error("expected ',' or '}' in a repetition")),
        };
        if hi.is_some_and(|h| h < lo) {
            return Err(self.error(format!("repetition {{{lo},{}}} is empty", hi.unwrap_or(0))));
        }
        Ok((lo, hi))
    }

    /// One character of a literal or class, escapes decoded.
    fn char_in(&mut self, what: &str) -> Result<char, GbnfError> {
        match self.bump() {
            None => Err(self.error(format!("unterminated {what}"))),
            Some('\\') => {
                let hex = |p: &mut Self, n: usize| -> Result<char, GbnfError> {
                    let digits: String = (0..n).filter_map(|_| p.bump()).collect();
                    u32::from_str_radix(&digits, 16)
                        .ok()
                        .and_then(char::from_u32)
                        .ok_or_else(|| p.error(format!("bad escape '\\{digits}'")))
                };
                match self.bump() {
                    Some('n') => Ok('\n'),
                    Some('r') => Ok('\r'),
                    Some('t') => Ok('\t'),
                    Some('x') => hex(self, 2),
                    Some('u') => hex(self, 4),
                    Some('U') => hex(self, 8),
                    Some(c) => Ok(c),
                    None => Err(self.error(format!("unterminated {what}"))),
                }
            }
            Some(c) => Ok(c),
        }
    }

    fn literal(&mut self) -> Result<String, GbnfError> {
        self.bump();
        let mut out = String::new();
        loop {
            if self.peek() == Some('"') {
                self.bump();
                return Ok(out);
            }
            out.push(self.char_in("string")?);
        }
    }

    fn class(&mut self) -> Result<Node, GbnfError> {
        self.bump();
        let negated = self.peek() == Some('^');
        if negated {
            self.bump();
        }
        let mut ranges = Vec::new();
        loop {
            if self.peek() == Some(']') {
                self.bump();
                return Ok(Node::Class(negated, ranges));
            }
            let first = self.char_in("character class")?;
            let mut last = first;
            if self.peek() == Some('-') && !self.src[self.pos + 1..].starts_with(']') {
                self.bump();
                last = self.char_in("character class")?;
                if last < first {
                    return Err(self.error(format!("empty range '{first}-{last}'")));
                }
            }
            ranges.push((first, last));
        }
    }
}

/// A character for a regex character class, escaped unless it is a letter or a digit.
fn class_char(c: char, out: &mut String) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:x}}}", c as u32);
    }
}

/// A JSON string literal (Lark strings use JSON syntax; DEL must be escaped too).
fn lark_string(s: &str) -> String {
    serde_json::Value::String(s.to_string())
        .to_string()
        .replace('\u{7f}', "\\u007f")
}

struct Writer<'a> {
    names: &'a HashMap<String, String>,
}

impl Writer<'_> {
    fn node(&self, n: &Node, out: &mut String) -> Result<(), String> {
        match n {
            Node::Literal(s) => out.push_str(&lark_string(s)),
            Node::Class(negated, ranges) => {
                out.push_str(if *negated { "/[^" } else { "/[" });
                for &(a, b) in ranges {
                    class_char(a, out);
                    if b != a {
                        out.push('-');
                        class_char(b, out);
                    }
                }
                out.push_str("]/");
                if ranges.is_empty() && !negated {
                    return Err("an empty character class '[]' matches nothing".into());
                }
            }
            Node::Any => out.push_str("/(?s:.)/"),
            Node::Rule(r) => match self.names.get(r) {
                Some(name) => out.push_str(name),
                None => return Err(format!("rule '{r}' is used but not defined")),
            },
            Node::Seq(items) if items.is_empty() => out.push_str("\"\""),
            Node::Seq(items) => {
                for (i, it) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(' ');
                    }
                    self.grouped(it, matches!(it, Node::Alt(_)), out)?;
                }
            }
            Node::Alt(alts) => {
                for (i, a) in alts.iter().enumerate() {
                    if i > 0 {
                        out.push_str(" | ");
                    }
                    self.node(a, out)?;
                }
            }
            Node::Repeat(inner, lo, hi) => {
                let compound = matches!(**inner, Node::Alt(_) | Node::Repeat(..))
                    || matches!(&**inner, Node::Seq(items) if items.len() != 1);
                self.grouped(inner, compound, out)?;
                match (lo, hi) {
                    (0, None) => out.push('*'),
                    (1, None) => out.push('+'),
                    (0, Some(1)) => out.push('?'),
                    (lo, None) => {
                        let _ = write!(out, "{{{lo},}}");
                    }
                    (lo, Some(hi)) => {
                        let _ = write!(out, "{{{lo},{hi}}}");
                    }
                }
            }
        }
        Ok(())
    }

    /// A node, in parentheses when `compound`.
    fn grouped(&self, n: &Node, compound: bool, out: &mut String) -> Result<(), String> {
        if compound {
            out.push('(');
        }
        self.node(n, out)?;
        if compound {
            out.push(')');
        }
        Ok(())
    }
}

/// Whether `src` is GBNF (it defines rules with `::=`) rather than a Lark grammar.
pub fn looks_like_gbnf(src: &str) -> bool {
    src.contains("::=")
}

/// The Lark grammar for a GBNF grammar: a `start` rule for `root` and one rule per GBNF rule.
pub fn gbnf_to_lark(src: &str) -> Result<String, GbnfError> {
    let mut parser = Parser { src, pos: 0 };
    let rules = parser.grammar()?;
    if rules.is_empty() {
        return Err(GbnfError {
            line: 1,
            message: "the grammar defines no rule".into(),
        });
    }
    // Lark rule names: lowercase letters, digits, '_' and '-', starting with a letter.
    let mut names: HashMap<String, String> = HashMap::new();
    let mut taken: HashMap<String, usize> = HashMap::new();
    for (name, _) in &rules {
        if names.contains_key(name) {
            continue;
        }
        let base: String = format!("g_{}", name.to_ascii_lowercase());
        let n = taken.entry(base.clone()).or_insert(0);
        let lark = if *n == 0 { base } else { format!("{base}_{n}") };
        *n += 1;
        names.insert(name.clone(), lark);
    }
    let Some(root) = names.get("root") else {
        return Err(GbnfError {
            line: 1,
            message: "the grammar has no 'root' rule (where the output starts)".into(),
        });
    };
    let mut out = format!("start: {root}\n");
    let writer = Writer { names: &names };
    let mut defined: HashMap<&str, Vec<&Node>> = HashMap::new();
    for (name, body) in &rules {
        defined.entry(name.as_str()).or_default().push(body);
    }
    let mut written = std::collections::HashSet::new();
    for (name, _) in &rules {
        if !written.insert(name.as_str()) {
            continue;
        }
        let lark = &names[name];
        let _ = write!(out, "{lark}: ");
        // A rule defined twice has both bodies as alternatives (llama.cpp merges them too).
        for (i, body) in defined[name.as_str()].iter().enumerate() {
            if i > 0 {
                out.push_str(" | ");
            }
            writer.node(body, &mut out).map_err(|message| GbnfError {
                line: src[..src.find(name.as_str()).unwrap_or(0)]
                    .matches('\n')
                    .count()
                    + 1,
                message,
            })?;
        }
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_the_common_constructs() {
        let g = r#"
# a greeting
root ::= greeting " " name ("!" | "?")? [0-9]{1,3}
greeting ::= "hello" | "hi\n"
name ::= [A-Z] [a-z-]* .
"#;
        let lark = gbnf_to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: g_root\n\
             g_root: g_greeting \" \" g_name (\"!\" | \"?\")? /[0-9]/{1,3}\n\
             g_greeting: \"hello\" | \"hi\\n\"\n\
             g_name: /[A-Z]/ /[a-z\\x{2d}]/* /(?s:.)/\n"
        );
    }

    #[test]
    fn escapes_and_negated_classes() {
        let lark =
            gbnf_to_lark(r#"root ::= "\"q\x41" [^"\\\x7F\x00-\x1F] ws  ws ::= | " ""#).unwrap();
        assert!(
            lark.contains(r#"g_root: "\"qA" /[^\x{22}\x{5c}\x{7f}\x{0}-\x{1f}]/ g_ws"#),
            "{lark}"
        );
        assert!(lark.contains(r#"g_ws: "" | " ""#), "{lark}");
    }

    #[test]
    fn errors_name_the_problem_and_the_line() {
        let e = gbnf_to_lark("root ::= a\n").unwrap_err();
        assert!(
            e.message.contains("rule 'a' is used but not defined"),
            "{e}"
        );
        let e = gbnf_to_lark("start ::= \"x\"").unwrap_err();
        assert!(e.message.contains("no 'root' rule"), "{e}");
        let e = gbnf_to_lark("root ::= \"x\"\nfoo ::= (\"a\"").unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        assert!(e.message.contains("')'"), "{e}");
        let e = gbnf_to_lark("root ::= \"abc").unwrap_err();
        assert!(e.message.contains("unterminated string"), "{e}");
        let e = gbnf_to_lark("root ::= [z-a]").unwrap_err();
        assert!(e.message.contains("empty range"), "{e}");
        assert!(looks_like_gbnf("root ::= \"a\"") && !looks_like_gbnf("start: \"a\""));
    }
}
