//! Fast hashing and a text -> id index over the vocabulary that does not copy the token strings.
//!
//! Building a 248k-token tokenizer is dominated by string hashing; SipHash's flood resistance buys
//! nothing for keys that come from the model file itself.

use std::hash::{BuildHasherDefault, Hasher};

const SEED: u64 = 0x51_7C_C1_B7_27_22_0A_95;

/// FxHash-style multiply-rotate hasher, eight bytes at a time.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        // The multiply leaves the low bits weak and tables index by them: finish with a full mix.
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        x ^ (x >> 33)
    }
}

pub(crate) type FastBuild = BuildHasherDefault<FastHasher>;

fn hash_text(text: &str) -> u64 {
    let mut h = FastHasher::default();
    h.write(text.as_bytes());
    h.write_u8(0xFF);
    h.finish()
}

const EMPTY: u64 = u64::MAX;

/// Open-addressing table of token ids keyed by the token's text in the vocabulary. Each slot holds
/// the upper half of the text's hash next to the id, so probes rarely touch the token strings.
pub(crate) struct TokenIndex {
    slots: Vec<u64>,
    mask: usize,
}

fn slot_value(hash: u64, id: u32) -> u64 {
    (hash & 0xFFFF_FFFF_0000_0000) | u64::from(id)
}

impl TokenIndex {
    /// Indexes `tokens`; on a repeated text returns the (first, second) ids instead.
    pub fn build(tokens: &[String]) -> Result<TokenIndex, (u32, u32)> {
        let capacity = (tokens.len() * 2).next_power_of_two().max(8);
        let mut index = TokenIndex {
            slots: vec![EMPTY; capacity],
            mask: capacity - 1,
        };
        for (id, text) in tokens.iter().enumerate() {
            let hash = hash_text(text);
            let mut slot = hash as usize & index.mask;
            loop {
                let occupant = index.slots[slot];
                if occupant == EMPTY {
                    index.slots[slot] = slot_value(hash, id as u32);
                    break;
                }
                let other = occupant as u32;
                if occupant >> 32 == hash >> 32 && tokens[other as usize] == *text {
                    return Err((other, id as u32));
                }
                slot = (slot + 1) & index.mask;
            }
        }
        Ok(index)
    }

    /// Id of the token whose text is `text`; `tokens` must be the slice the index was built from.
    pub fn get(&self, tokens: &[String], text: &str) -> Option<u32> {
        let hash = hash_text(text);
        let mut slot = hash as usize & self.mask;
        loop {
            let occupant = self.slots[slot];
            if occupant == EMPTY {
                return None;
            }
            let id = occupant as u32;
            if occupant >> 32 == hash >> 32 && tokens.get(id as usize).is_some_and(|t| t == text) {
                return Some(id);
            }
            slot = (slot + 1) & self.mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_token_and_rejects_duplicates() {
        let tokens: Vec<String> = (0..1000).map(|i| format!("t{i}")).collect();
        let index = TokenIndex::build(&tokens).expect("distinct");
        for (i, t) in tokens.iter().enumerate() {
            assert_eq!(index.get(&tokens, t), Some(i as u32));
        }
        assert_eq!(index.get(&tokens, "t1000"), None);
        assert_eq!(index.get(&tokens, ""), None);
        let dup: Vec<String> = ["a", "b", "a"].iter().map(|s| s.to_string()).collect();
        assert_eq!(TokenIndex::build(&dup).err(), Some((0, 2)));
    }
}
