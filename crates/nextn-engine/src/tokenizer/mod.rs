//! Text <-> token ids for GGUF byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`),
//! reproducing llama.cpp's tokenizer (src/llama-vocab.cpp, src/unicode.cpp) id for id.
//!
//! Encoding: the text is cut at special tokens (CONTROL / UNKNOWN / USER_DEFINED tokens, longest
//! first; CONTROL and UNKNOWN only when `parse_special`), each remaining fragment is split into words
//! by the pre-tokenizer of `tokenizer.ggml.pre`, and each word is merged by BPE rank. No Unicode
//! normalisation is applied (llama.cpp applies none, unlike Qwen's HF tokenizer which applies NFC).

mod bpe;
mod gguf;
mod lookup;
mod pretokenize;
mod stream;
mod unicode;
mod vocab;

use bpe::{BpeScratch, MergeTable};
use lookup::TokenIndex;
use pretokenize::{SplitRules, Splitter};
use vocab::TokenAttr;

pub use stream::StreamDecoder;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] nextn_gguf::GgufError),
    #[error("GGUF key {key} is missing")]
    MissingKey { key: &'static str },
    #[error("GGUF key {key} holds {found}, expected {expected}")]
    KeyType {
        key: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("tokenizer model {0:?} is not supported (only \"gpt2\", byte-level BPE)")]
    UnsupportedModel(String),
    #[error("pre-tokenizer {0:?} (tokenizer.ggml.pre) is not supported; supported: qwen35, qwen2 and aliases, llama3 family")]
    UnsupportedPreTokenizer(String),
    #[error("the vocabulary (tokenizer.ggml.tokens) is empty")]
    EmptyVocab,
    #[error("the vocabulary has {0} tokens, more than 32-bit token ids can address")]
    VocabTooLarge(usize),
    #[error("tokenizer.ggml.token_type has {types} entries for {tokens} tokens")]
    TokenTypeCount { types: usize, tokens: usize },
    #[error("token {text:?} appears twice in the vocabulary, at ids {first} and {second}")]
    DuplicateToken {
        text: String,
        first: u32,
        second: u32,
    },
    #[error("tokenizer.ggml.add_bos_token is true but no BOS token id is set")]
    MissingBos,
}

/// Everything a tokenizer is built from, as GGUF stores it.
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`; only "gpt2" is supported.
    pub model: String,
    /// `tokenizer.ggml.pre`: selects the pre-tokenizer ("qwen35", "qwen2", ...).
    pub pre: Option<String>,
    /// Token texts, in GPT-2 byte-to-unicode form for normal tokens, plain text for special ones.
    pub tokens: Vec<String>,
    /// GGUF token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte);
    /// all normal when absent.
    pub token_types: Option<Vec<i32>>,
    /// "left right" merge lines; the index is the rank.
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
}

/// Pre-tokenizer settings selected by `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy)]
struct PreTokenizer {
    rules: SplitRules,
    /// Look a whole word up in the vocabulary before merging (llama3 family).
    ignore_merges: bool,
}

fn pre_tokenizer(name: &str) -> Option<PreTokenizer> {
    let plain = |rules| {
        Some(PreTokenizer {
            rules,
            ignore_merges: false,
        })
    };
    match name {
        "qwen35" => plain(SplitRules::QWEN35),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan" => {
            plain(SplitRules::QWEN2)
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => Some(PreTokenizer {
            rules: SplitRules::LLAMA3,
            ignore_merges: true,
        }),
        "dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe" => plain(SplitRules::LLAMA3),
        _ => None,
    }
}

/// A loaded byte-level BPE tokenizer. Immutable; share it freely between threads.
pub struct Tokenizer {
    model: String,
    pre: String,
    pre_tokenizer: PreTokenizer,
    tokens: Vec<String>,
    attrs: Vec<TokenAttr>,
    token_index: TokenIndex,
    merges: MergeTable,
    byte_chars: [char; 256],
    /// `llama_token_to_piece(special = true)` of every token, concatenated.
    pieces: Vec<u8>,
    piece_offsets: Vec<usize>,
    /// Tokens matched verbatim in text, longest first.
    special_tokens: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model)
            .field("pre", &self.pre)
            .field("vocab_size", &self.tokens.len())
            .field("merges", &self.merges.merge_count())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .finish()
    }
}

enum Fragment {
    Text(usize, usize),
    Token(u32),
}

impl Tokenizer {
    pub fn new(mut spec: TokenizerSpec) -> Result<Self, TokenizerError> {
        let merges = std::mem::take(&mut spec.merges);
        Tokenizer::build(spec, &merges)
    }

    /// Builds from a spec whose merges are given separately (borrowed from the GGUF metadata).
    fn build(spec: TokenizerSpec, merge_lines: &[String]) -> Result<Self, TokenizerError> {
        if spec.model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(spec.model));
        }
        // Without the key llama.cpp falls back to its "default" pre-tokenizer.
        let pre = spec.pre.clone().unwrap_or_else(|| "default".to_owned());
        let pre_tokenizer = pre_tokenizer(&pre)
            .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(pre.clone()))?;
        let mut tokens = spec.tokens;
        if tokens.is_empty() {
            return Err(TokenizerError::EmptyVocab);
        }
        let n_vocab = u32::try_from(tokens.len())
            .ok()
            .filter(|&n| n < u32::MAX)
            .ok_or(TokenizerError::VocabTooLarge(tokens.len()))?;

        let mut attrs = match &spec.token_types {
            Some(types) if types.len() < tokens.len() => {
                return Err(TokenizerError::TokenTypeCount {
                    types: types.len(),
                    tokens: tokens.len(),
                })
            }
            Some(types) => types[..tokens.len()]
                .iter()
                .map(|&t| TokenAttr::from_gguf_type(t))
                .collect(),
            None => vec![TokenAttr::NORMAL; tokens.len()],
        };

        for (id, text) in tokens.iter_mut().enumerate() {
            if text.is_empty() {
                // llama.cpp gives empty tokens a placeholder text so they can never match.
                *text = format!("[EMPTY_{id}]");
            }
        }
        let token_index = TokenIndex::build(&tokens).map_err(|(first, second)| {
            TokenizerError::DuplicateToken {
                text: tokens[first as usize].clone(),
                first,
                second,
            }
        })?;

        // Ids outside the vocabulary are ignored, as llama.cpp does.
        let in_vocab = |id: Option<u32>| id.filter(|&id| id < n_vocab);
        let (bos, eos, pad) = (in_vocab(spec.bos), in_vocab(spec.eos), in_vocab(spec.pad));
        if spec.add_bos && bos.is_none() {
            return Err(TokenizerError::MissingBos);
        }
        let detected = vocab::detect_specials(&tokens, &mut attrs, eos, in_vocab(spec.eot));

        let byte_chars = unicode::byte_to_char_table();
        let merges = MergeTable::build(
            &|text| token_index.get(&tokens, text),
            n_vocab,
            merge_lines,
            &byte_chars,
        );

        let char_to_byte = unicode::char_to_byte_table(&byte_chars);
        let mut pieces = Vec::with_capacity(tokens.len() * 6);
        let mut piece_offsets = Vec::with_capacity(tokens.len() + 1);
        piece_offsets.push(0);
        for (text, &attr) in tokens.iter().zip(&attrs) {
            append_piece(text, attr, &char_to_byte, &mut pieces);
            piece_offsets.push(pieces.len());
        }

        let verbatim = TokenAttr::CONTROL
            .with(TokenAttr::USER_DEFINED)
            .with(TokenAttr::UNKNOWN);
        let mut special_tokens: Vec<u32> = (0..n_vocab)
            .filter(|&id| attrs[id as usize].has(verbatim))
            .collect();
        special_tokens.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].len()));

        Ok(Tokenizer {
            model: spec.model,
            pre,
            pre_tokenizer,
            tokens,
            attrs,
            token_index,
            merges,
            byte_chars,
            pieces,
            piece_offsets,
            special_tokens,
            bos,
            eos,
            eot: detected.eot,
            pad,
            add_bos: spec.add_bos,
            eog: detected.eog,
        })
    }

    /// Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(f: &nextn_gguf::GgufFile) -> Result<Self, TokenizerError> {
        let (spec, merges) = TokenizerSpec::from_gguf_without_merges(f)?;
        Tokenizer::build(spec, merges)
    }

    /// Token ids of `text`, with BOS first when the vocabulary asks for it (Qwen does not).
    /// With `parse_special`, control tokens written in the text (`<|im_start|>`) become their ids;
    /// user-defined tokens (`<think>`) are matched either way.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        self.encode_from(text, parse_special, self.add_bos)
    }

    /// Token ids of `text` that continues a prompt already begun (never a BOS): the text between
    /// two images of a prompt.
    pub fn encode_continuation(&self, text: &str, parse_special: bool) -> Vec<u32> {
        self.encode_from(text, parse_special, false)
    }

    fn encode_from(&self, text: &str, parse_special: bool, add_bos: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos {
            out.extend(self.bos);
        }
        if text.is_empty() {
            return out;
        }
        let mut splitter = Splitter::default();
        let mut scratch = BpeScratch::default();
        let mut words = Vec::new();
        let mut encoded_word = String::new();
        for fragment in self.partition(text, parse_special) {
            let (start, end) = match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    continue;
                }
                Fragment::Text(start, end) => (start, end),
            };
            let fragment_text = &text[start..end];
            words.clear();
            splitter.split(self.pre_tokenizer.rules, fragment_text, &mut words);
            for &(a, b) in &words {
                let word = &fragment_text.as_bytes()[a..b];
                if self.pre_tokenizer.ignore_merges {
                    encoded_word.clear();
                    encoded_word.extend(word.iter().map(|&byte| self.byte_chars[byte as usize]));
                    if let Some(id) = self.token_index.get(&self.tokens, &encoded_word) {
                        out.push(id);
                        continue;
                    }
                }
                self.merges.encode_word(word, &mut scratch, &mut out);
            }
        }
        out
    }

    /// Cuts `text` at verbatim special tokens: for each special, longest first, every remaining text
    /// fragment is split at its non-overlapping occurrences, left to right (llama.cpp's order, which
    /// differs from a single leftmost-longest scan when specials overlap).
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut fragments = vec![Fragment::Text(0, text.len())];
        let skipped_without_parse = TokenAttr::CONTROL.with(TokenAttr::UNKNOWN);
        for &id in &self.special_tokens {
            if !parse_special && self.attrs[id as usize].has(skipped_without_parse) {
                continue;
            }
            let pattern = self.tokens[id as usize].as_str();
            if !text.contains(pattern) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(start, end) = fragment else {
                    next.push(fragment);
                    continue;
                };
                let mut cursor = start;
                for (at, _) in text[start..end].match_indices(pattern) {
                    if start + at > cursor {
                        next.push(Fragment::Text(cursor, start + at));
                    }
                    next.push(Fragment::Token(id));
                    cursor = start + at + pattern.len();
                }
                if cursor < end {
                    next.push(Fragment::Text(cursor, end));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// The bytes a token stands for (special tokens: their text; unused tokens: nothing).
    /// Empty for ids outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let id = id as usize;
        match (self.piece_offsets.get(id), self.piece_offsets.get(id + 1)) {
            (Some(&start), Some(&end)) => &self.pieces[start..end],
            _ => &[],
        }
    }

    /// Text of a token sequence, special tokens included as their text; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// Raw bytes of a token sequence (concatenated [`token_bytes`](Self::token_bytes)).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        bytes
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Whether generation stops at this token (EOS, EOT and llama.cpp's end-of-generation texts:
    /// for Qwen <|endoftext|>, <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|>).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Whether [`Tokenizer::encode`] puts BOS first (the vocabulary asks for it; Qwen does not).
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// End-of-turn token: the declared one, else the first of llama.cpp's end-of-turn texts.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Id of the token whose vocabulary text is exactly `text` (GGUF form: "Ġhello" for " hello",
    /// plain text for special tokens such as "<|im_end|>").
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_index.get(&self.tokens, text)
    }

    /// Vocabulary text of a token (GGUF form).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Whether the token is a control token (after llama.cpp's retyping of chat / FIM tokens).
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a.has(TokenAttr::CONTROL))
    }

    pub fn model_name(&self) -> &str {
        &self.model
    }

    pub fn pre_name(&self) -> &str {
        &self.pre
    }

    pub fn merge_count(&self) -> usize {
        self.merges.merge_count()
    }

    /// A [`StreamDecoder`] over this vocabulary.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }
}

/// llama.cpp's `token_to_piece(special = true)` for byte-level BPE.
fn append_piece(text: &str, attr: TokenAttr, char_to_byte: &[Option<u8>], out: &mut Vec<u8>) {
    let verbatim = TokenAttr::CONTROL
        .with(TokenAttr::USER_DEFINED)
        .with(TokenAttr::UNKNOWN);
    if attr.has(verbatim) {
        out.extend_from_slice(text.as_bytes());
    } else if attr.has(TokenAttr::NORMAL) || attr.has(TokenAttr::BYTE) {
        for c in text.chars() {
            match char_to_byte.get(c as usize).copied().flatten() {
                Some(byte) => out.push(byte),
                None => {
                    // llama.cpp's marker for a char outside the byte alphabet, whole token text included.
                    out.extend_from_slice(b"[UNK_BYTE_0x");
                    let mut buf = [0u8; 4];
                    for b in c.encode_utf8(&mut buf).bytes() {
                        out.extend_from_slice(format!("{b:02x}").as_bytes());
                    }
                    out.extend_from_slice(text.as_bytes());
                    out.push(b']');
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
