//! The pre-tokenizer: splits a text fragment into words before BPE.
//!
//! Hand-written equivalent of the Qwen-family split regex as llama.cpp evaluates it
//! (`(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|
//! ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`): alternatives are tried in order at each
//! position and the first that matches wins, as in a backtracking engine. `qwen35` widens the letter
//! runs to `[\p{L}\p{M}]` and removes `\p{M}` from the punctuation runs; the llama3 family groups up to
//! three digits. Each fragment is split on its own (a fragment ends at a special token, so `(?!\S)`
//! sees the fragment end as "no non-space").

use super::unicode::{classify, CharClass};

/// Which split regex a vocabulary uses (from `tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitRules {
    /// Letter runs also absorb combining marks (`qwen35`).
    pub marks_join_letters: bool,
    /// Longest digit group per word: 1 for Qwen, 3 for the llama3 family.
    pub max_digits: usize,
}

impl SplitRules {
    pub const QWEN2: SplitRules = SplitRules {
        marks_join_letters: false,
        max_digits: 1,
    };
    pub const QWEN35: SplitRules = SplitRules {
        marks_join_letters: true,
        max_digits: 1,
    };
    pub const LLAMA3: SplitRules = SplitRules {
        marks_join_letters: false,
        max_digits: 3,
    };
}

/// Reusable buffers for splitting.
#[derive(Default)]
pub(crate) struct Splitter {
    offsets: Vec<usize>,
    chars: Vec<char>,
    classes: Vec<CharClass>,
}

impl Splitter {
    /// Splits `text` into words and appends their byte ranges (in order, covering `text`) to `out`.
    pub fn split(&mut self, rules: SplitRules, text: &str, out: &mut Vec<(usize, usize)>) {
        self.offsets.clear();
        self.chars.clear();
        self.classes.clear();
        for (offset, c) in text.char_indices() {
            self.offsets.push(offset);
            self.chars.push(c);
            self.classes.push(classify(c));
        }
        self.offsets.push(text.len());
        let n = self.chars.len();
        let chars = &self.chars;
        let classes = &self.classes;
        let offsets = &self.offsets;

        let class_at = |i: usize| if i < n { Some(classes[i]) } else { None };
        let is_letter_run = |i: usize| match class_at(i) {
            Some(CharClass::Letter) => true,
            Some(CharClass::Mark) => rules.marks_join_letters,
            _ => false,
        };
        // `[^\s\p{L}\p{N}]` (qwen35: also not `\p{M}`).
        let is_punct_run = |i: usize| match class_at(i) {
            Some(CharClass::Other) => true,
            Some(CharClass::Mark) => !rules.marks_join_letters,
            _ => false,
        };
        let is_cr_lf = |i: usize| i < n && (chars[i] == '\r' || chars[i] == '\n');

        let mut start = 0usize;
        let mut pos = 0usize;
        let mut emit = |end: usize, start: &mut usize| {
            if end > *start {
                out.push((offsets[*start], offsets[end]));
            }
            *start = end;
        };

        while pos < n {
            let c = chars[pos];
            let class = classes[pos];

            // 's 't 're 've 'm 'll 'd, ASCII case-insensitive.
            if c == '\'' && pos + 1 < n {
                let c1 = chars[pos + 1].to_ascii_lowercase();
                if matches!(c1, 's' | 't' | 'm' | 'd') {
                    pos += 2;
                    emit(pos, &mut start);
                    continue;
                }
                if pos + 2 < n {
                    let c2 = chars[pos + 2].to_ascii_lowercase();
                    if matches!((c1, c2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                        pos += 3;
                        emit(pos, &mut start);
                        continue;
                    }
                }
            }

            // [^\r\n\p{L}\p{N}]?\p{L}+ : an optional leading non-letter (not CR/LF, not a digit) glued
            // to a letter run.
            if c != '\r'
                && c != '\n'
                && class != CharClass::Number
                && (is_letter_run(pos) || is_letter_run(pos + 1))
            {
                pos += 1;
                while is_letter_run(pos) {
                    pos += 1;
                }
                emit(pos, &mut start);
                continue;
            }

            // \p{N} (or \p{N}{1,3}).
            if class == CharClass::Number {
                let group_start = pos;
                while class_at(pos) == Some(CharClass::Number)
                    && pos - group_start < rules.max_digits
                {
                    pos += 1;
                }
                emit(pos, &mut start);
                continue;
            }

            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`.
            if is_punct_run(pos) || (c == ' ' && is_punct_run(pos + 1)) {
                if c == ' ' {
                    pos += 1;
                }
                while is_punct_run(pos) {
                    pos += 1;
                }
                while is_cr_lf(pos) {
                    pos += 1;
                }
                emit(pos, &mut start);
                continue;
            }

            // Here `c` is whitespace: every other class was taken above.
            let mut run = 0usize;
            let mut after_last_cr_lf = None;
            while class_at(pos + run) == Some(CharClass::Whitespace) {
                if is_cr_lf(pos + run) {
                    after_last_cr_lf = Some(pos + run + 1);
                }
                run += 1;
            }
            if let Some(end) = after_last_cr_lf {
                // \s*[\r\n]+
                pos = end;
            } else if run > 1 && pos + run < n {
                // \s+(?!\S): leave the last space to prefix the following word.
                pos += run - 1;
            } else if run > 0 {
                // \s+
                pos += run;
            } else {
                pos += 1;
            }
            emit(pos, &mut start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(rules: SplitRules, text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        Splitter::default().split(rules, text, &mut out);
        out.iter().map(|&(a, b)| &text[a..b]).collect()
    }

    #[test]
    fn splits_like_the_qwen_regex() {
        let q = SplitRules::QWEN35;
        assert_eq!(words(q, "Hello world"), ["Hello", " world"]);
        assert_eq!(
            words(q, "I'm you're IT'S"),
            ["I", "'m", " you", "'re", " IT", "'S"]
        );
        assert_eq!(
            words(q, "x = 1234;"),
            ["x", " =", " ", "1", "2", "3", "4", ";"]
        );
        assert_eq!(words(q, "a  b   "), ["a", " ", " b", "   "]);
        assert_eq!(words(q, "end\n\n\n"), ["end", "\n\n\n"]);
        assert_eq!(words(q, "  \n  x"), ["  \n", " ", " x"]);
        assert_eq!(
            words(q, "f(x):\n    return"),
            ["f", "(x", "):\n", "   ", " return"]
        );
        assert_eq!(words(q, "\u{a0}nbsp"), ["\u{a0}nbsp"]);
        assert_eq!(words(q, "...\r\n"), ["...\r\n"]);
        assert_eq!(words(q, " 'x"), [" '", "x"]);
    }

    #[test]
    fn combining_marks_join_letters_only_for_qwen35() {
        let text = "cafe\u{301} n\u{303}";
        assert_eq!(
            words(SplitRules::QWEN35, text),
            ["cafe\u{301}", " n\u{303}"]
        );
        assert_eq!(
            words(SplitRules::QWEN2, text),
            ["cafe", "\u{301}", " n", "\u{303}"]
        );
    }

    #[test]
    fn llama3_groups_three_digits() {
        assert_eq!(words(SplitRules::LLAMA3, "1234567"), ["123", "456", "7"]);
    }

    #[test]
    fn words_cover_the_text() {
        let text = "mixed中文English混合123数字 \t\u{3000}x ~~ 😀👍🏽 \u{200b}zero";
        let joined: String = words(SplitRules::QWEN35, text).concat();
        assert_eq!(joined, text);
    }

    /// Random strings split by Python's `regex` module with llama.cpp's exact patterns (the pool
    /// avoids U+001C..U+001F, where Python's `\s` and llama.cpp's whitespace class disagree).
    #[test]
    fn agrees_with_a_backtracking_regex_engine() {
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(include_str!("split_vectors.json")).expect("vectors");
        assert!(cases.len() >= 400);
        for case in &cases {
            let text = case["text"].as_str().expect("text");
            for (name, rules) in [("qwen35", SplitRules::QWEN35), ("qwen2", SplitRules::QWEN2)] {
                let expected: Vec<&str> = case[name]
                    .as_array()
                    .expect("words")
                    .iter()
                    .map(|w| w.as_str().expect("word"))
                    .collect();
                assert_eq!(words(rules, text), expected, "{name} {text:?}");
            }
        }
    }
}
