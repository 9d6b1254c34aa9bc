//! The tokenizer a synthesized file carries: the real Qwen3.5 / Qwen3.6 byte-level BPE vocabulary
//! (or a prefix of it for small test models), its merges, special tokens and a chat template.
//!
//! The source is the compact `models/qwen35-vocab.bin` (written by `tools/make_qwen35_vocab.py`
//! from the tiktoken rank file): raw token bytes in rank order plus the added tokens. GGUF wants
//! GPT-2 byte-to-unicode spellings and an explicit merge list; both are derived here. A tiktoken
//! rank file has no merges: token `r` is formed by the BPE merge that tiktoken would apply last
//! when encoding its own bytes with only the ranks below `r` available.

use std::collections::HashMap;

use nextn_gguf::{MetadataArray, MetadataValue};

use super::SynthError;

/// llama.cpp token types.
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_USER_DEFINED: i32 = 4;
pub const TOKEN_UNUSED: i32 = 5;

/// 256 byte tokens and the three control tokens a chat needs.
pub const MIN_N_VOCAB: usize = 259;

const MAGIC: &[u8; 8] = b"NXQVOCAB";

/// A Qwen3.5-style chat template (ChatML turns, `<think>` reasoning blocks, tool calls and tool
/// responses, `enable_thinking`), written for these files.
pub const QWEN35_CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");

/// The decoded vocabulary file.
#[derive(Clone, Debug)]
pub struct RawVocab {
    /// Token bytes, index = rank = token id.
    pub bpe: Vec<Vec<u8>>,
    /// (id, llama.cpp token type, text) of each added token, ids following the BPE tokens.
    pub specials: Vec<(u32, i32, String)>,
}

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], SynthError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| SynthError::Vocab {
                offset: self.pos as u64,
                why: format!(
                    "truncated: {what} needs {n} bytes, {} left",
                    self.data.len() - self.pos
                ),
            })?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32, SynthError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

impl RawVocab {
    /// Parses `models/qwen35-vocab.bin`.
    pub fn parse(data: &[u8]) -> Result<RawVocab, SynthError> {
        let mut c = Cursor { data, pos: 0 };
        if c.take(8, "magic")? != MAGIC {
            return Err(SynthError::Vocab {
                offset: 0,
                why: "not a vocabulary file (bad magic)".into(),
            });
        }
        let at = c.pos as u64;
        let version = c.u32("version")?;
        if version != 1 {
            return Err(SynthError::Vocab {
                offset: at,
                why: format!("version {version}, expected 1"),
            });
        }
        let n_bpe = c.u32("token count")? as usize;
        let n_special = c.u32("special count")? as usize;
        // Each token takes at least one byte, so the counts are bounded by the data itself.
        if n_bpe.saturating_add(n_special) > data.len() {
            return Err(SynthError::Vocab {
                offset: 12,
                why: format!(
                    "{n_bpe} + {n_special} tokens cannot fit in {} bytes",
                    data.len()
                ),
            });
        }
        let mut bpe = Vec::with_capacity(n_bpe);
        for i in 0..n_bpe {
            let len = c.take(1, "token length")?[0] as usize;
            let at = c.pos as u64;
            let bytes = c.take(len, "token bytes")?;
            if bytes.is_empty() {
                return Err(SynthError::Vocab {
                    offset: at,
                    why: format!("token {i} is empty"),
                });
            }
            bpe.push(bytes.to_vec());
        }
        let mut specials = Vec::with_capacity(n_special);
        for _ in 0..n_special {
            let at = c.pos as u64;
            let id = c.u32("special id")?;
            let ty = c.u32("special type")? as i32;
            let len = c.take(1, "special length")?[0] as usize;
            let text = std::str::from_utf8(c.take(len, "special text")?).map_err(|_| {
                SynthError::Vocab {
                    offset: at,
                    why: format!("special token {id} is not UTF-8"),
                }
            })?;
            if id as usize != n_bpe + specials.len() {
                return Err(SynthError::Vocab {
                    offset: at,
                    why: format!(
                        "special token ids must follow the BPE tokens in order; found {id}"
                    ),
                });
            }
            specials.push((id, ty, text.to_owned()));
        }
        if c.pos != data.len() {
            return Err(SynthError::Vocab {
                offset: c.pos as u64,
                why: "trailing bytes".into(),
            });
        }
        let raw = RawVocab { bpe, specials };
        raw.check_bytes()?;
        Ok(raw)
    }

    /// Byte-level BPE needs every single byte as a token, and ranks 0..255 are exactly those.
    fn check_bytes(&self) -> Result<(), SynthError> {
        let mut seen = [false; 256];
        for t in self.bpe.iter().take(256) {
            if t.len() == 1 {
                seen[t[0] as usize] = true;
            }
        }
        match seen.iter().position(|s| !s) {
            Some(b) => Err(SynthError::Vocab {
                offset: 0,
                why: format!("byte {b:#04x} is not among the first 256 tokens"),
            }),
            None => Ok(()),
        }
    }

    fn special_id(&self, text: &str) -> Option<u32> {
        self.specials.iter().find(|s| s.2 == text).map(|s| s.0)
    }
}

/// GPT-2's reversible byte → printable character map used by byte-level BPE vocabularies.
pub fn byte_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        // Every value is below 0x144, a valid scalar.
        map[b as usize] = char::from_u32(c).unwrap_or('\u{FFFD}');
    }
    map
}

fn spell(map: &[char; 256], bytes: &[u8]) -> String {
    bytes.iter().map(|&b| map[b as usize]).collect()
}

/// How token `rank` is formed: the length of its left part, or `None` when no split into two
/// tokens exists (tiktoken emits such tokens only by whole-piece lookup).
///
/// First choice: run tiktoken's BPE over the token's bytes with only lower ranks available; if
/// that stops at two parts, they are the merge. Otherwise (the ranks are not a pure merge
/// sequence there) the split into two existing tokens whose larger rank is smallest.
fn merge_split(rank: u32, bytes: &[u8], ranks: &HashMap<&[u8], u32>) -> Option<usize> {
    let mut bounds: Vec<usize> = (0..=bytes.len()).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..bounds.len() - 2 {
            if let Some(&r) = ranks.get(&bytes[bounds[i]..bounds[i + 2]]) {
                if r < rank && best.is_none_or(|(b, _)| r < b) {
                    best = Some((r, i));
                }
            }
        }
        match best {
            Some((_, i)) => {
                bounds.remove(i + 1);
            }
            None => break,
        }
    }
    if bounds.len() == 3 {
        return Some(bounds[1]);
    }
    (1..bytes.len())
        .filter_map(|k| {
            let l = *ranks.get(&bytes[..k])?;
            let r = *ranks.get(&bytes[k..])?;
            Some((l.max(r), l, k))
        })
        .min()
        .map(|(_, _, k)| k)
}

/// Left-part lengths for every token of `bpe` (index = rank); `None` for single bytes and for
/// tokens no merge can form.
pub fn merge_splits(bpe: &[Vec<u8>]) -> Vec<Option<usize>> {
    let ranks: HashMap<&[u8], u32> = bpe
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r as u32))
        .collect();
    bpe.iter()
        .enumerate()
        .map(|(r, t)| {
            if t.len() < 2 {
                None
            } else {
                merge_split(r as u32, t, &ranks)
            }
        })
        .collect()
}

/// Everything `tokenizer.*` in a GGUF.
#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    /// `"left right"` in GPT-2 spelling, highest priority first.
    pub merges: Vec<String>,
    pub bos: u32,
    pub eos: u32,
    pub pad: u32,
    pub chat_template: String,
}

impl Vocab {
    /// The Qwen vocabulary for an `n_vocab`-row embedding. At least 248,077 rows: all BPE tokens,
    /// all added tokens, then `[PAD<id>]` unused rows, like the real checkpoints (248,320).
    /// Fewer rows (down to [`MIN_N_VOCAB`]): the first `n_vocab − 3` BPE ranks — a consistent
    /// smaller BPE, since every merge only uses lower ranks — plus `<|endoftext|>`, `<|im_start|>`
    /// and `<|im_end|>`.
    pub fn qwen(raw: &RawVocab, n_vocab: usize) -> Result<Vocab, SynthError> {
        let map = byte_to_unicode();
        let full = raw.bpe.len() + raw.specials.len();
        let chat = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
        for c in chat {
            if raw.special_id(c).is_none() {
                return Err(SynthError::Vocab {
                    offset: 0,
                    why: format!("the vocabulary lacks {c}"),
                });
            }
        }
        if n_vocab < MIN_N_VOCAB {
            return Err(SynthError::BadSpec {
                field: "vocab",
                why: format!("{n_vocab} tokens: at least {MIN_N_VOCAB}"),
            });
        }
        let n_bpe = if n_vocab >= full {
            raw.bpe.len()
        } else {
            n_vocab - chat.len()
        };
        let bpe = &raw.bpe[..n_bpe];
        let mut tokens: Vec<String> = bpe.iter().map(|t| spell(&map, t)).collect();
        let mut token_types = vec![TOKEN_NORMAL; n_bpe];
        // Splits are computed within the kept ranks, so a truncated vocabulary only merges into
        // tokens it has.
        let merges: Vec<String> = bpe
            .iter()
            .zip(merge_splits(bpe))
            .filter_map(|(t, split)| {
                split.map(|k| format!("{} {}", spell(&map, &t[..k]), spell(&map, &t[k..])))
            })
            .collect();
        if n_vocab >= full {
            for (_, ty, text) in &raw.specials {
                tokens.push(text.clone());
                token_types.push(*ty);
            }
            for id in full..n_vocab {
                tokens.push(format!("[PAD{id}]"));
                token_types.push(TOKEN_UNUSED);
            }
        } else {
            for c in chat {
                tokens.push(c.to_owned());
                token_types.push(TOKEN_CONTROL);
            }
        }
        let find = |text: &str| -> Result<u32, SynthError> {
            tokens
                .iter()
                .rposition(|t| t == text)
                .map(|i| i as u32)
                .ok_or_else(|| SynthError::Vocab {
                    offset: 0,
                    why: format!("{text} missing"),
                })
        };
        let endoftext = find("<|endoftext|>")?;
        let im_end = find("<|im_end|>")?;
        Ok(Vocab {
            tokens,
            token_types,
            merges,
            bos: endoftext,
            eos: im_end,
            pad: endoftext,
            chat_template: QWEN35_CHAT_TEMPLATE.to_owned(),
        })
    }

    /// The `tokenizer.*` keys, as llama.cpp's converter writes them for Qwen3.5.
    pub fn metadata(&self) -> Vec<(String, MetadataValue)> {
        vec![
            ("tokenizer.ggml.model".into(), "gpt2".into()),
            ("tokenizer.ggml.pre".into(), "qwen35".into()),
            (
                "tokenizer.ggml.tokens".into(),
                MetadataArray::String(self.tokens.clone()).into(),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                MetadataArray::I32(self.token_types.clone()).into(),
            ),
            (
                "tokenizer.ggml.merges".into(),
                MetadataArray::String(self.merges.clone()).into(),
            ),
            (
                "tokenizer.ggml.eos_token_id".into(),
                MetadataValue::U32(self.eos),
            ),
            (
                "tokenizer.ggml.padding_token_id".into(),
                MetadataValue::U32(self.pad),
            ),
            (
                "tokenizer.ggml.bos_token_id".into(),
                MetadataValue::U32(self.bos),
            ),
            (
                "tokenizer.ggml.add_bos_token".into(),
                MetadataValue::Bool(false),
            ),
            (
                "tokenizer.chat_template".into(),
                self.chat_template.as_str().into(),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A miniature rank file: the 256 bytes (in GPT-2 order is not required here), then merges.
    fn mini() -> RawVocab {
        let mut bpe: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for t in [&b"ab"[..], b"abc", b"cd", b"abcd", b"xyz"] {
            bpe.push(t.to_vec());
        }
        let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .iter()
            .enumerate()
            .map(|(i, s)| ((bpe.len() + i) as u32, TOKEN_CONTROL, s.to_string()))
            .collect();
        RawVocab { bpe, specials }
    }

    fn encode(raw: &RawVocab) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        for v in [1u32, raw.bpe.len() as u32, raw.specials.len() as u32] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for t in &raw.bpe {
            out.push(t.len() as u8);
            out.extend_from_slice(t);
        }
        for (id, ty, text) in &raw.specials {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&ty.to_le_bytes());
            out.push(text.len() as u8);
            out.extend_from_slice(text.as_bytes());
        }
        out
    }

    #[test]
    fn byte_map_is_gpt2s() {
        let m = byte_to_unicode();
        assert_eq!(m[b'A' as usize], 'A');
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert_eq!(m[0], 'Ā');
        let distinct: std::collections::HashSet<char> = m.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn merges_follow_bpe_order() {
        let raw = mini();
        let s = merge_splits(&raw.bpe);
        assert_eq!(s[256], Some(1), "ab = a + b");
        assert_eq!(s[257], Some(2), "abc = ab + c");
        assert_eq!(
            s[259],
            Some(3),
            "abcd = abc + d: BPE forms ab, then abc, before cd"
        );
        assert_eq!(s[260], None, "xyz: no split into two tokens");
        assert_eq!(s[97], None);
    }

    #[test]
    fn parse_round_trips_and_rejects_damage() {
        let raw = mini();
        let bytes = encode(&raw);
        let back = RawVocab::parse(&bytes).unwrap();
        assert_eq!(back.bpe, raw.bpe);
        assert_eq!(back.specials, raw.specials);
        assert!(matches!(
            RawVocab::parse(&bytes[..bytes.len() - 1]),
            Err(SynthError::Vocab { .. })
        ));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(RawVocab::parse(&bad).is_err());
        let mut huge = bytes.clone();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(RawVocab::parse(&huge).is_err());
    }

    #[test]
    fn full_and_truncated_vocabularies() {
        let raw = mini();
        let full = Vocab::qwen(&raw, 270).unwrap();
        assert_eq!(full.tokens.len(), 270);
        assert_eq!(full.tokens[261], "<|endoftext|>");
        assert_eq!(full.tokens[269], "[PAD269]");
        assert_eq!(full.token_types[269], TOKEN_UNUSED);
        assert_eq!((full.bos, full.eos, full.pad), (261, 263, 261));
        assert_eq!(full.merges, vec!["a b", "ab c", "c d", "abc d"]);

        let small = Vocab::qwen(&raw, 260).unwrap();
        assert_eq!(small.tokens.len(), 260);
        assert_eq!(
            &small.tokens[257..],
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        );
        assert_eq!(small.merges, vec!["a b"]);
        assert_eq!(small.eos, 259);
        assert!(Vocab::qwen(&raw, 100).is_err());
    }
}
