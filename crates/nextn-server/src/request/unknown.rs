//! Request fields a server does not know are ignored, as OpenAI-compatible servers do, and named
//! in the log once each when debug logging is on. A client can send any number of names, so what
//! is remembered is bounded: at most [`MAX_REMEMBERED`] names of at most [`MAX_NAME`] characters
//! for the life of the process, and nothing at all without debug logging.

use std::collections::HashSet;
use std::sync::Mutex;

use serde_json::{Map, Value};

/// Distinct unknown names remembered (so each is logged once); past it, names are counted only.
const MAX_REMEMBERED: usize = 256;
/// Characters of a name kept and logged.
const MAX_NAME: usize = 64;
/// Names listed in one log line.
const MAX_PER_LINE: usize = 16;

static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// The names of `o`'s fields outside `known` not named before, at most [`MAX_PER_LINE`], and how
/// many others were left out.
fn first_seen(o: &Map<String, Value>, known: &[&[&str]]) -> (Vec<String>, usize) {
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let seen = seen.get_or_insert_with(HashSet::new);
    let mut named = Vec::new();
    let mut others = 0;
    for k in o.keys() {
        if known.iter().any(|list| list.contains(&k.as_str())) {
            continue;
        }
        let name: String = k.chars().take(MAX_NAME).collect();
        if seen.contains(&name) {
            continue;
        }
        if seen.len() < MAX_REMEMBERED && named.len() < MAX_PER_LINE {
            seen.insert(name.clone());
            named.push(name);
        } else {
            others += 1;
        }
    }
    (named, others)
}

/// Log the fields of `o` that `api` does not know (`known`), once each, when `debug` is on.
pub(crate) fn log_unknown(debug: bool, api: &str, o: &Map<String, Value>, known: &[&[&str]]) {
    if !debug {
        return;
    }
    let (named, others) = first_seen(o, known);
    if named.is_empty() && others == 0 {
        return;
    }
    let more = if others > 0 {
        format!(" (and {others} more not listed)")
    } else {
        String::new()
    };
    eprintln!(
        "debug: {api} ignores unknown request fields: {}{more}",
        named
            .iter()
            .map(|n| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_remembered_is_bounded() {
        let mut o = Map::new();
        for k in 0..5000 {
            o.insert(format!("field-{k}-{}", "x".repeat(500)), Value::Null);
        }
        o.insert("model".into(), Value::Null);
        let (named, others) = first_seen(&o, &[&["model"]]);
        assert!(named.len() <= MAX_PER_LINE && named.iter().all(|n| n.chars().count() <= MAX_NAME));
        assert_eq!(named.len() + others, 5000);
        for _ in 0..100 {
            first_seen(&o, &[&["model"]]);
        }
        let seen = SEEN.lock().unwrap();
        let seen = seen.as_ref().unwrap();
        assert!(seen.len() <= MAX_REMEMBERED);
        assert!(seen.iter().all(|n| n.chars().count() <= MAX_NAME));
    }
}
