//! Stored responses, for `previous_response_id` and `GET /v1/responses/{id}`: in memory, the
//! oldest dropped first once there are too many or they take too much room.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

/// Most responses kept.
const MAX_RESPONSES: usize = 1024;
/// Most bytes (as JSON) all kept responses and their conversations take together.
const MAX_BYTES: usize = 256 << 20;

/// One stored response.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Stored {
    /// The Response object as it was answered.
    pub response: Value,
    /// Everything a follow-up continues: the conversation it was answered from and its output.
    pub conversation: Vec<Value>,
    bytes: usize,
}

#[derive(Default)]
struct Inner {
    order: VecDeque<String>,
    by_id: HashMap<String, Stored>,
    bytes: usize,
}

pub(crate) struct Store {
    inner: Mutex<Inner>,
    max_responses: usize,
    max_bytes: usize,
}

impl Default for Store {
    fn default() -> Self {
        Store::with_limits(MAX_RESPONSES, MAX_BYTES)
    }
}

impl Store {
    fn with_limits(max_responses: usize, max_bytes: usize) -> Self {
        Store {
            inner: Mutex::new(Inner::default()),
            max_responses,
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keep a response under its `id`; a response larger than the whole store is not kept.
    pub fn put(&self, id: String, response: Value, conversation: Vec<Value>) {
        let bytes = response.to_string().len()
            + conversation
                .iter()
                .map(|v| v.to_string().len())
                .sum::<usize>();
        if bytes > self.max_bytes {
            return;
        }
        let mut s = self.lock();
        if let Some(old) = s.by_id.remove(&id) {
            s.bytes -= old.bytes;
            s.order.retain(|k| k != &id);
        }
        while !s.order.is_empty()
            && (s.order.len() >= self.max_responses || s.bytes + bytes > self.max_bytes)
        {
            if let Some(oldest) = s.order.pop_front() {
                if let Some(old) = s.by_id.remove(&oldest) {
                    s.bytes -= old.bytes;
                }
            }
        }
        s.bytes += bytes;
        s.order.push_back(id.clone());
        s.by_id.insert(
            id,
            Stored {
                response,
                conversation,
                bytes,
            },
        );
    }

    pub fn get(&self, id: &str) -> Option<Stored> {
        self.lock().by_id.get(id).cloned()
    }

    /// Forget a response; whether it was stored.
    pub fn remove(&self, id: &str) -> bool {
        let mut s = self.lock();
        match s.by_id.remove(id) {
            Some(old) => {
                s.bytes -= old.bytes;
                s.order.retain(|k| k != id);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn oldest_go_first_by_count_and_by_size() {
        let s = Store::with_limits(2, 1000);
        for id in ["a", "b", "c"] {
            s.put(id.into(), json!({"id": id}), vec![json!("x")]);
        }
        assert!(s.get("a").is_none());
        assert_eq!(s.get("c").unwrap().response["id"], "c");
        assert!(s.remove("b") && !s.remove("b"));
        let big = "y".repeat(600);
        s.put("d".into(), json!(big), vec![]);
        s.put("e".into(), json!(big), vec![]);
        assert!(s.get("d").is_none() && s.get("e").is_some() && s.get("c").is_none());
        // Larger than the whole store: not kept, nothing else dropped.
        s.put("f".into(), json!("z".repeat(2000)), vec![]);
        assert!(s.get("f").is_none() && s.get("e").is_some());
    }
}
