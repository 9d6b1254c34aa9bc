//! Stored responses, for `previous_response_id` and `GET /v1/responses/{id}`: in memory, each
//! bound to the API key that made it (another key finds nothing), the oldest dropped first once
//! there are too many or they take too much room, and none larger than [`MAX_ENTRY_BYTES`].

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde_json::Value;

/// Most responses kept.
const MAX_RESPONSES: usize = 1024;
/// Most bytes (as JSON) all kept responses and their conversations take together.
const MAX_BYTES: usize = 256 << 20;
/// Most bytes one response and its conversation may take: a conversation is sent again on every
/// turn it continues, so one past this would not be a request the server takes either.
pub(crate) const MAX_ENTRY_BYTES: usize = 32 << 20;

/// Who made a response: the index of the API key its request gave (`None` where the server
/// takes no keys).
pub(crate) type Owner = Option<usize>;

/// The bytes of `v` as JSON, without writing it out.
pub(crate) fn json_bytes(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    // Writing a Value into a sink that cannot fail does not fail.
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

/// One stored response.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Stored {
    /// The Response object as it was answered.
    pub response: Value,
    /// Everything a follow-up continues: the conversation it was answered from and its output.
    pub conversation: Vec<Value>,
    bytes: usize,
}

type Key = (Owner, String);

#[derive(Default)]
struct Inner {
    order: VecDeque<Key>,
    by_id: HashMap<Key, Stored>,
    bytes: usize,
}

pub(crate) struct Store {
    inner: Mutex<Inner>,
    max_responses: usize,
    max_bytes: usize,
    max_entry: usize,
}

impl Default for Store {
    fn default() -> Self {
        Store::with_limits(MAX_RESPONSES, MAX_BYTES, MAX_ENTRY_BYTES)
    }
}

impl Store {
    fn with_limits(max_responses: usize, max_bytes: usize, max_entry: usize) -> Self {
        Store {
            inner: Mutex::new(Inner::default()),
            max_responses,
            max_bytes,
            max_entry,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keep `owner`'s response under its `id`; whether it was kept (one larger than
    /// [`MAX_ENTRY_BYTES`] is not). Counting its size walks the whole conversation: call it off
    /// the async threads.
    pub fn put(&self, owner: Owner, id: String, response: Value, conversation: Vec<Value>) -> bool {
        let bytes = json_bytes(&response) + conversation.iter().map(json_bytes).sum::<usize>();
        if bytes > self.max_entry.min(self.max_bytes) {
            return false;
        }
        let key = (owner, id);
        let mut s = self.lock();
        if let Some(old) = s.by_id.remove(&key) {
            s.bytes -= old.bytes;
            s.order.retain(|k| k != &key);
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
        s.order.push_back(key.clone());
        s.by_id.insert(
            key,
            Stored {
                response,
                conversation,
                bytes,
            },
        );
        true
    }

    /// `owner`'s response `id` (another owner's is not found).
    pub fn get(&self, owner: Owner, id: &str) -> Option<Stored> {
        self.lock().by_id.get(&(owner, id.to_string())).cloned()
    }

    /// Forget `owner`'s response `id`; whether it was stored.
    pub fn remove(&self, owner: Owner, id: &str) -> bool {
        let key = (owner, id.to_string());
        let mut s = self.lock();
        match s.by_id.remove(&key) {
            Some(old) => {
                s.bytes -= old.bytes;
                s.order.retain(|k| k != &key);
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
        let s = Store::with_limits(2, 1000, 800);
        for id in ["a", "b", "c"] {
            assert!(s.put(None, id.into(), json!({"id": id}), vec![json!("x")]));
        }
        assert!(s.get(None, "a").is_none());
        assert_eq!(s.get(None, "c").unwrap().response["id"], "c");
        assert!(s.remove(None, "b") && !s.remove(None, "b"));
        let big = "y".repeat(600);
        s.put(None, "d".into(), json!(big), vec![]);
        s.put(None, "e".into(), json!(big), vec![]);
        assert!(
            s.get(None, "d").is_none() && s.get(None, "e").is_some() && s.get(None, "c").is_none()
        );
        // Larger than an entry may be: not kept, nothing else dropped.
        assert!(!s.put(None, "f".into(), json!("z".repeat(900)), vec![]));
        assert!(s.get(None, "f").is_none() && s.get(None, "e").is_some());
        assert_eq!(
            json_bytes(&json!({"a": [1, "b"]})),
            json!({"a": [1, "b"]}).to_string().len()
        );
    }

    #[test]
    fn a_response_is_its_owners_only() {
        let s = Store::default();
        s.put(Some(0), "r".into(), json!({}), vec![]);
        assert!(s.get(Some(0), "r").is_some());
        assert!(s.get(Some(1), "r").is_none() && s.get(None, "r").is_none());
        assert!(!s.remove(Some(1), "r") && s.get(Some(0), "r").is_some());
        assert!(s.remove(Some(0), "r"));
    }
}
