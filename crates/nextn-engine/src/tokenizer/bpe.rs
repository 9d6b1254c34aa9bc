//! Byte-level BPE merging, the way llama.cpp's `llm_tokenizer_bpe_session` does it.
//!
//! A word starts as one symbol per byte (each byte is one char of the GPT-2 printable alphabet).
//! The adjacent pair with the lowest merge rank is merged first, ties going to the leftmost pair,
//! until no adjacent pair has a rank. A final symbol that is not a vocabulary token falls back to
//! the one-byte tokens of its text's ASCII bytes (which drops it in practice), as llama.cpp does.
//!
//! Symbols are interned strings: vocabulary tokens use their token id, and merge products that are
//! not vocabulary tokens get ids from `n_vocab` up, so merging works on integers only.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::lookup::FastBuild;

/// Symbol id of a byte whose printable char appears neither in the vocabulary nor in any merge.
const NO_SYMBOL: u32 = u32::MAX;
const NO_INDEX: usize = usize::MAX;

type PairMap = HashMap<u64, Merge, FastBuild>;

#[derive(Debug, Clone, Copy)]
struct Merge {
    rank: u32,
    merged: u32,
}

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

pub(crate) struct MergeTable {
    merges: PairMap,
    /// Initial symbol of each raw byte.
    byte_symbols: [u32; 256],
    n_vocab: u32,
    /// Texts of interned merge products that are not vocabulary tokens (symbol id - n_vocab).
    extra_texts: Vec<String>,
    /// Token of each one-byte ASCII string, for the fallback of non-token symbols.
    ascii_tokens: [Option<u32>; 128],
}

impl MergeTable {
    /// `merges` are GGUF merge lines ("left right"); the line index is the rank.
    /// `token_id` looks a text up in the vocabulary.
    pub fn build(
        token_id: &dyn Fn(&str) -> Option<u32>,
        n_vocab: u32,
        merges: &[String],
        byte_chars: &[char; 256],
    ) -> MergeTable {
        let mut extra_ids: HashMap<String, u32, FastBuild> = HashMap::default();
        let mut extra_texts: Vec<String> = Vec::new();
        // None only when the symbol ids would run into NO_SYMBOL (over four billion symbols).
        let mut intern = |text: &str, extra_ids: &mut HashMap<String, u32, FastBuild>| {
            if let Some(id) = token_id(text) {
                return Some(id);
            }
            if let Some(&id) = extra_ids.get(text) {
                return Some(id);
            }
            let id = u32::try_from(extra_texts.len())
                .ok()
                .and_then(|n| n_vocab.checked_add(n))
                .filter(|&id| id != NO_SYMBOL)?;
            extra_texts.push(text.to_owned());
            extra_ids.insert(text.to_owned(), id);
            Some(id)
        };

        let mut table = PairMap::default();
        table.reserve(merges.len());
        let mut joined = String::new();
        for (rank, line) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte; a line without one yields
            // an empty pair that no symbol pair can match.
            let Some(split) = line.bytes().skip(1).position(|b| b == b' ').map(|i| i + 1) else {
                continue;
            };
            let (left, right) = (&line[..split], &line[split + 1..]);
            if left.is_empty() || right.is_empty() {
                continue;
            }
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let (Some(left_id), Some(right_id), Some(merged)) = (
                intern(left, &mut extra_ids),
                intern(right, &mut extra_ids),
                intern(&joined, &mut extra_ids),
            ) else {
                continue;
            };
            // The first line for a pair wins, like `std::map::emplace`.
            table.entry(pair_key(left_id, right_id)).or_insert(Merge {
                rank: rank as u32,
                merged,
            });
        }

        let mut byte_symbols = [NO_SYMBOL; 256];
        let mut buf = [0u8; 4];
        for (byte, symbol) in byte_symbols.iter_mut().enumerate() {
            let text: &str = byte_chars[byte].encode_utf8(&mut buf);
            *symbol = token_id(text)
                .or_else(|| extra_ids.get(text).copied())
                .unwrap_or(NO_SYMBOL);
        }

        let mut ascii_tokens = [None; 128];
        for (byte, slot) in ascii_tokens.iter_mut().enumerate() {
            let text = [byte as u8];
            if let Ok(text) = std::str::from_utf8(&text) {
                *slot = token_id(text);
            }
        }

        MergeTable {
            merges: table,
            byte_symbols,
            n_vocab,
            extra_texts,
            ascii_tokens,
        }
    }

    /// Number of distinct merge pairs.
    pub fn merge_count(&self) -> usize {
        self.merges.len()
    }

    /// Appends the tokens of one pre-tokenized word (raw bytes) to `out`.
    pub fn encode_word(&self, word: &[u8], scratch: &mut BpeScratch, out: &mut Vec<u32>) {
        if word.len() == 1 {
            self.emit_symbol(self.byte_symbols[word[0] as usize], out);
            return;
        }
        let symbols = &mut scratch.symbols;
        let queue = &mut scratch.queue;
        symbols.clear();
        queue.clear();
        for (i, &b) in word.iter().enumerate() {
            symbols.push(Symbol {
                id: self.byte_symbols[b as usize],
                prev: if i == 0 { NO_INDEX } else { i - 1 },
                next: if i + 1 == word.len() { NO_INDEX } else { i + 1 },
                alive: true,
            });
        }
        for i in 1..symbols.len() {
            self.push_pair(symbols, queue, i - 1, i);
        }

        while let Some(Reverse(pending)) = queue.pop() {
            let (left, right) = (pending.left as usize, pending.right as usize);
            let (l, r) = (symbols[left], symbols[right]);
            if !l.alive || !r.alive || l.id != pending.left_id || r.id != pending.right_id {
                continue; // outdated: one side has merged since this pair was queued
            }
            symbols[left].id = pending.merged;
            symbols[left].next = r.next;
            symbols[right].alive = false;
            if r.next != NO_INDEX {
                symbols[r.next].prev = left;
            }
            if l.prev != NO_INDEX {
                self.push_pair(symbols, queue, l.prev, left);
            }
            if r.next != NO_INDEX {
                self.push_pair(symbols, queue, left, r.next);
            }
        }

        let mut i = 0;
        while i != NO_INDEX {
            let symbol = symbols[i];
            self.emit_symbol(symbol.id, out);
            i = symbol.next;
        }
    }

    fn push_pair(
        &self,
        symbols: &[Symbol],
        queue: &mut BinaryHeap<Reverse<PendingMerge>>,
        left: usize,
        right: usize,
    ) {
        let (left_id, right_id) = (symbols[left].id, symbols[right].id);
        if let Some(m) = self.merges.get(&pair_key(left_id, right_id)) {
            queue.push(Reverse(PendingMerge {
                rank: m.rank,
                left: left as u32,
                right: right as u32,
                left_id,
                right_id,
                merged: m.merged,
            }));
        }
    }

    fn emit_symbol(&self, id: u32, out: &mut Vec<u32>) {
        if id < self.n_vocab {
            out.push(id);
            return;
        }
        if id == NO_SYMBOL {
            return;
        }
        if let Some(text) = self.extra_texts.get((id - self.n_vocab) as usize) {
            for &b in text.as_bytes() {
                if let Some(Some(token)) = self.ascii_tokens.get(b as usize) {
                    out.push(*token);
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

/// Ordered by (rank, left position) first: lowest rank, then leftmost, merges first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct PendingMerge {
    rank: u32,
    left: u32,
    right: u32,
    left_id: u32,
    right_id: u32,
    merged: u32,
}

/// Buffers reused across words.
#[derive(Default)]
pub(crate) struct BpeScratch {
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Reverse<PendingMerge>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::unicode::byte_to_char_table;

    fn table(tokens: &[&str], merges: &[&str]) -> MergeTable {
        let map: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges: Vec<String> = merges.iter().map(|s| s.to_string()).collect();
        MergeTable::build(
            &|text| map.get(text).copied(),
            tokens.len() as u32,
            &merges,
            &byte_to_char_table(),
        )
    }

    fn encode(t: &MergeTable, word: &str) -> Vec<u32> {
        let mut out = Vec::new();
        t.encode_word(word.as_bytes(), &mut BpeScratch::default(), &mut out);
        out
    }

    #[test]
    fn merges_lowest_rank_first_and_leftmost_on_ties() {
        // tokens: a b c ab bc abc
        let t = table(&["a", "b", "c", "ab", "bc", "abc"], &["b c", "a b", "a bc"]);
        assert_eq!(encode(&t, "abc"), [5]); // b+c first (rank 0), then a+bc
        let t = table(&["a", "ab", "aa"], &["a a"]);
        // "aaa": pairs (0,1) and (1,2) share rank 0; the left one merges.
        assert_eq!(encode(&t, "aaa"), [2, 0]);
    }

    #[test]
    fn non_token_merge_product_falls_back_to_ascii_tokens() {
        // "x y" merges to "xy", which is not a token: llama.cpp emits the one-byte tokens.
        let t = table(&["x", "y"], &["x y"]);
        assert_eq!(encode(&t, "xy"), [0, 1]);
        // A byte without any token vanishes.
        assert_eq!(encode(&t, "xz"), [0]);
    }
}
