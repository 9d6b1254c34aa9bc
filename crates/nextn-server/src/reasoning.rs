//! `--reasoning-format deepseek`: the `<think>…</think>` part of a reply goes to
//! `reasoning_content`, the rest to `content` — also while streaming, where a tag may arrive split
//! across pieces and is held back until it is whole.

/// The tags of a reasoning block.
pub const OPEN: &str = "<think>";
pub const CLOSE: &str = "</think>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing decided yet: the reply may start with `<think>` (after whitespace).
    Start,
    Reasoning,
    /// Right after `</think>`: leading newlines of the answer are dropped.
    AfterClose,
    Content,
}

/// Splits streamed text into (reasoning, content) pieces.
#[derive(Clone, Debug)]
pub struct ReasoningSplitter {
    state: State,
    held: String,
}

/// The reasoning budget an effort level (Anthropic's `output_config.effort`, the Responses API's
/// `reasoning.effort`) leaves out of an answer of at most `allowance` tokens: `low` a quarter of
/// it, `medium` half, higher levels no cap (the allowance itself bounds the reasoning). The models
/// have no effort setting of their own; how long they think is what an effort can change.
pub fn effort_budget(effort: &str, allowance: u64) -> Option<u64> {
    match effort {
        "low" => Some(allowance / 4),
        "medium" => Some(allowance / 2),
        _ => None,
    }
}

/// Whether a rendered prompt leaves the model inside an open `<think>` block (templates with
/// thinking on end the generation prompt with `<think>\n`).
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    match prompt.rfind(OPEN) {
        Some(at) => !prompt[at..].contains(CLOSE) && prompt[at + OPEN.len()..].trim().is_empty(),
        None => false,
    }
}

impl ReasoningSplitter {
    pub fn new(starts_in_reasoning: bool) -> Self {
        ReasoningSplitter {
            state: if starts_in_reasoning {
                State::Reasoning
            } else {
                State::Start
            },
            held: String::new(),
        }
    }

    /// Add generated text; returns the (reasoning, content) text that is now certain.
    pub fn push(&mut self, text: &str) -> (String, String) {
        self.held.push_str(text);
        let mut reasoning = String::new();
        let mut content = String::new();
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if trimmed.starts_with(OPEN) {
                        let at = self.held.len() - trimmed.len() + OPEN.len();
                        self.held.drain(..at);
                        self.state = State::Reasoning;
                    } else if trimmed.is_empty() || OPEN.starts_with(trimmed) {
                        break;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => match self.held.find(CLOSE) {
                    Some(at) => {
                        reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + CLOSE.len());
                        self.state = State::AfterClose;
                    }
                    None => {
                        let keep = partial_suffix(&self.held, CLOSE);
                        let cut = self.held.len() - keep;
                        reasoning.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        break;
                    }
                },
                State::AfterClose => {
                    let rest = self.held.trim_start_matches(['\n', '\r']);
                    if rest.is_empty() {
                        self.held.clear();
                        break;
                    }
                    self.held = rest.to_string();
                    self.state = State::Content;
                }
                State::Content => {
                    content.push_str(&self.held);
                    self.held.clear();
                    break;
                }
            }
        }
        (reasoning, content)
    }

    /// End of generation: whatever was held back, where it belongs.
    pub fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Reasoning => (held, String::new()),
            State::AfterClose => (String::new(), String::new()),
            State::Start | State::Content => (String::new(), held),
        }
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(start: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningSplitter::new(start);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let (a, b) = s.push(p);
            r += &a;
            c += &b;
        }
        let (a, b) = s.finish();
        (r + &a, c + &b)
    }

    #[test]
    fn tags_split_across_pieces() {
        let text = "<think>\nplan it</think>\n\nThe answer.";
        let want = ("\nplan it".to_string(), "The answer.".to_string());
        for cut in 0..=text.len() {
            let (a, b) = text.split_at(cut);
            assert_eq!(split_all(false, &[a, b]), want, "cut at {cut}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split_all(false, &pieces), want);
    }

    #[test]
    fn forced_open_and_plain_replies() {
        assert_eq!(
            split_all(true, &["hmm", "</th", "ink>", "ok"]),
            ("hmm".into(), "ok".into())
        );
        assert_eq!(
            split_all(false, &["  <thi", "s is no tag"]),
            (String::new(), "  <this is no tag".into())
        );
        assert_eq!(
            split_all(false, &["Hello"]),
            (String::new(), "Hello".into())
        );
        // An unclosed block is all reasoning.
        assert_eq!(
            split_all(true, &["still thinking </thi"]),
            ("still thinking </thi".into(), String::new())
        );
    }

    #[test]
    fn prompt_detection() {
        assert!(prompt_opens_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_thinking(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_thinking("<|im_start|>assistant\n"));
        assert!(!prompt_opens_thinking("user wrote <think> then more text"));
    }
}
