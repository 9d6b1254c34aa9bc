//! A trimmed draft LM head: the NextN head's output projection restricted to a subset of the
//! vocabulary, and the token rankings that choose the subset.
//!
//! The head's LM head is the largest matrix a draft step reads (the full vocabulary × n_embd), so
//! restricting it to the most frequent tokens makes drafting cheap. Logits come back
//! full-vocabulary-shaped with −∞ outside the subset, so every consumer (argmax, the p-min check,
//! the p/q acceptance rule, whose q is then exactly the distribution drafts are drawn from) works
//! unchanged, and the target still verifies over the whole vocabulary: output stays exact.

use std::path::Path;

use nextn_gguf::GgmlType;
use nextn_quant::kernels::ThreadPool;

use crate::weights::{Linear, WeightLoader};
use crate::ModelError;

/// Where a trimmed head's rows live.
enum Rows {
    /// The ids are exactly `0..n`: rows are a prefix of the mapped matrix, no copy.
    Prefix(Linear),
    /// Rows gathered from the mapped matrix (quantized rows are whole blocks: a byte copy), with
    /// the full matrix they came from (its type, width and per-tensor scale).
    Gathered { bytes: Vec<u8>, full: Linear },
}

/// The rows of an LM head for the token ids of a draft vocabulary.
pub struct DraftLmHead {
    /// Kept token ids, ascending; row `i` of the trimmed matrix is token `ids[i]`.
    ids: Vec<u32>,
    rows: Rows,
    ty: GgmlType,
    cols: usize,
    n_vocab: usize,
}

impl DraftLmHead {
    /// Restrict `full` (rows = vocabulary) to `ids` (any order, duplicates ignored).
    pub fn new(full: &Linear, ids: &[u32]) -> Result<DraftLmHead, ModelError> {
        let n_vocab = full.rows;
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        if ids.is_empty() {
            return Err(ModelError::BadValue {
                key: "draft vocabulary".into(),
                why: "it is empty".into(),
            });
        }
        if let Some(&last) = ids.last() {
            if last as usize >= n_vocab {
                return Err(ModelError::TokenOutOfRange {
                    token: last as u64,
                    n_vocab,
                });
            }
        }
        let is_prefix = ids.last().is_some_and(|&l| l as usize + 1 == ids.len());
        let rows = if is_prefix {
            let whole = std::slice::from_ref(full);
            let mut v = WeightLoader::split_rows(whole, 0, ids.len());
            // split_rows keeps the file, tensor and scale of `full`; one matrix in, one out.
            Rows::Prefix(v.remove(0))
        } else {
            let rb = full.row_bytes();
            let all = full.bytes();
            let mut bytes = Vec::with_capacity(ids.len() * rb);
            for &id in &ids {
                let at = id as usize * rb;
                bytes.extend_from_slice(&all[at..at + rb]);
            }
            Rows::Gathered {
                bytes,
                full: full.clone(),
            }
        };
        Ok(DraftLmHead {
            ids,
            rows,
            ty: full.ty,
            cols: full.cols,
            n_vocab,
        })
    }

    /// Kept token ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Number of kept tokens (rows of the trimmed matrix).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Size of the full vocabulary the logits are shaped for.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Bytes of weights one product reads.
    pub fn weight_bytes(&self) -> usize {
        self.ids.len() * self.ty.row_bytes(self.cols as u64).unwrap_or(0) as usize
    }

    /// Whether the rows are a zero-copy prefix of the mapped matrix.
    pub fn is_prefix(&self) -> bool {
        matches!(self.rows, Rows::Prefix(_))
    }

    /// Logits of the kept tokens only: `out[i·len + k]` for token `ids[k]` of input row `i`.
    pub fn forward_kept(
        &self,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        match &self.rows {
            Rows::Prefix(l) => l.forward(x, n, out, pool),
            Rows::Gathered { bytes, full } => {
                full.forward_rows(bytes, self.ids.len(), x, n, out, pool)
            }
        }
    }

    /// The trimmed matrix as stored: its type, rows (one per kept id), width, bytes and scale.
    pub fn kept_matrix(&self) -> (GgmlType, usize, usize, &[u8], Option<f32>) {
        match &self.rows {
            Rows::Prefix(l) => (l.ty, self.ids.len(), self.cols, l.bytes(), l.scale()),
            Rows::Gathered { bytes, full } => {
                (full.ty, self.ids.len(), self.cols, bytes, full.scale())
            }
        }
    }

    /// Full-vocabulary logits from the kept tokens' logits (`n × ids().len()`): −∞ elsewhere.
    pub fn scatter(&self, kept: &[f32], n: usize) -> Vec<f32> {
        let k = self.ids.len();
        let mut logits = vec![f32::NEG_INFINITY; n * self.n_vocab];
        for (row, src) in logits
            .chunks_exact_mut(self.n_vocab)
            .zip(kept.chunks_exact(k.max(1)))
        {
            for (&id, &v) in self.ids.iter().zip(src) {
                row[id as usize] = v;
            }
        }
        logits
    }

    /// Full-vocabulary-shaped logits of `n` input rows: the kept tokens' logits, −∞ elsewhere.
    pub fn forward(&self, x: &[f32], n: usize, pool: &ThreadPool) -> Result<Vec<f32>, ModelError> {
        let mut kept = vec![0.0f32; n * self.ids.len()];
        self.forward_kept(x, n, &mut kept, pool)?;
        Ok(self.scatter(&kept, n))
    }
}

/// A problem with a token ranking (a file written by `nextn vocab-stats`, or the shipped one).
#[derive(Debug, thiserror::Error)]
pub enum RankingError {
    #[error("cannot read token ranking {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("token ranking {origin}, line {line}: {why}")]
    Line {
        origin: String,
        line: usize,
        why: String,
    },
    #[error("token ranking {origin}: {why}")]
    Format { origin: String, why: String },
    #[error("token ranking {origin}: token id {id} (line {line}) is out of range: the model's vocabulary has {n_vocab} tokens")]
    IdOutOfRange {
        origin: String,
        line: usize,
        id: u64,
        n_vocab: usize,
    },
    #[error("draft vocabulary size {n} is out of range: it must be between 1 and the vocabulary size {n_vocab}")]
    BadSize { n: usize, n_vocab: usize },
}

/// Magic of the compact binary ranking format.
pub const RANKING_MAGIC: &[u8; 8] = b"NXRANK01";

/// Token ids by descending frequency (a prefix of the vocabulary's ids, in rank order; tokens it
/// does not list come after it, in id order).
#[derive(Clone, Debug)]
pub struct TokenRanking {
    /// Ranked ids, each < the vocabulary size it was checked against, no duplicates.
    pub ids: Vec<u32>,
    /// Vocabulary size the ranking was built for (the binary format records it; text: unknown).
    pub n_vocab: Option<usize>,
    /// `(id, vocabulary text)` pairs that identify the tokenizer (binary format only).
    pub checks: Vec<(u32, String)>,
    /// What the ranking is (file name, or "BPE merge order").
    pub origin: String,
}

impl TokenRanking {
    /// Tokens in id order: for a byte-level BPE vocabulary that is merge order, and earlier merges
    /// joined more frequent pairs in the tokenizer's training corpus.
    pub fn by_id(n_vocab: usize) -> TokenRanking {
        TokenRanking {
            ids: (0..n_vocab as u32).collect(),
            n_vocab: Some(n_vocab),
            checks: Vec::new(),
            origin: "token id order (BPE merge order)".into(),
        }
    }

    /// Read a ranking file in either format (binary by its magic, else text).
    pub fn read(path: &Path, n_vocab: usize) -> Result<TokenRanking, RankingError> {
        let origin = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| RankingError::Io {
            path: origin.clone(),
            source,
        })?;
        Self::parse(&bytes, &origin, n_vocab)
    }

    /// Parse a ranking in either format; every id must be below `n_vocab`.
    pub fn parse(bytes: &[u8], origin: &str, n_vocab: usize) -> Result<TokenRanking, RankingError> {
        if bytes.starts_with(RANKING_MAGIC) {
            return Self::parse_binary(bytes, origin, n_vocab);
        }
        let text = std::str::from_utf8(bytes).map_err(|e| RankingError::Format {
            origin: origin.into(),
            why: format!(
                "neither a binary ranking (no {} magic) nor UTF-8 text (invalid byte at offset {})",
                String::from_utf8_lossy(RANKING_MAGIC),
                e.valid_up_to()
            ),
        })?;
        Self::parse_text(text, origin, n_vocab)
    }

    /// Text format: `#` comment lines, then one `ID COUNT` (or just `ID`) per line, most frequent first.
    pub fn parse_text(
        text: &str,
        origin: &str,
        n_vocab: usize,
    ) -> Result<TokenRanking, RankingError> {
        let mut ids = Vec::new();
        let mut seen = vec![false; n_vocab];
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let bad = |why: String| RankingError::Line {
                origin: origin.into(),
                line,
                why,
            };
            let mut fields = l.split_whitespace();
            let id_text = fields.next().unwrap_or_default();
            let id: u64 = id_text
                .parse()
                .map_err(|_| bad(format!("'{id_text}' is not a token id")))?;
            if let Some(c) = fields.next() {
                c.parse::<u64>()
                    .map_err(|_| bad(format!("'{c}' is not a count")))?;
            }
            if let Some(extra) = fields.next() {
                return Err(bad(format!(
                    "unexpected '{extra}': expected 'ID COUNT' or 'ID'"
                )));
            }
            if id >= n_vocab as u64 {
                return Err(RankingError::IdOutOfRange {
                    origin: origin.into(),
                    line,
                    id,
                    n_vocab,
                });
            }
            if std::mem::replace(&mut seen[id as usize], true) {
                return Err(bad(format!("token id {id} is listed twice")));
            }
            ids.push(id as u32);
        }
        if ids.is_empty() {
            return Err(RankingError::Format {
                origin: origin.into(),
                why: "it lists no token ids".into(),
            });
        }
        Ok(TokenRanking {
            ids,
            n_vocab: None,
            checks: Vec::new(),
            origin: origin.into(),
        })
    }

    /// Binary format: magic, u32 vocabulary size, u32 id count, u32 check count, then per check
    /// (u32 id, u16 byte length, UTF-8 token text), then the ids as u32; all little-endian.
    pub fn parse_binary(
        bytes: &[u8],
        origin: &str,
        n_vocab: usize,
    ) -> Result<TokenRanking, RankingError> {
        let fmt = |why: String| RankingError::Format {
            origin: origin.into(),
            why,
        };
        let mut at = RANKING_MAGIC.len();
        let mut take = |n: usize, what: &str| -> Result<&[u8], RankingError> {
            let s = bytes.get(at..at + n).ok_or_else(|| {
                fmt(format!(
                    "truncated at byte offset {at} while reading {what}"
                ))
            })?;
            at += n;
            Ok(s)
        };
        let u32_at = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let vocab = u32_at(take(4, "the vocabulary size")?) as usize;
        let count = u32_at(take(4, "the id count")?) as usize;
        let n_checks = u32_at(take(4, "the check count")?) as usize;
        if count > vocab || n_checks > 1024 {
            return Err(fmt(format!(
                "header says {count} ids and {n_checks} checks for a vocabulary of {vocab}"
            )));
        }
        let mut checks = Vec::with_capacity(n_checks);
        for _ in 0..n_checks {
            let id = u32_at(take(4, "a check id")?);
            let l = take(2, "a check length")?;
            let len = u16::from_le_bytes([l[0], l[1]]) as usize;
            let text = std::str::from_utf8(take(len, "a check text")?)
                .map_err(|_| fmt("a check text is not UTF-8".into()))?;
            checks.push((id, text.to_string()));
        }
        let body = take(count * 4, "the ids")?;
        let mut ids = Vec::with_capacity(count);
        let mut seen = vec![false; n_vocab];
        for (i, c) in body.chunks_exact(4).enumerate() {
            let id = u32_at(c) as u64;
            if id >= n_vocab as u64 {
                return Err(RankingError::IdOutOfRange {
                    origin: origin.into(),
                    line: i + 1,
                    id,
                    n_vocab,
                });
            }
            if std::mem::replace(&mut seen[id as usize], true) {
                return Err(fmt(format!(
                    "token id {id} (entry {}) is listed twice",
                    i + 1
                )));
            }
            ids.push(id as u32);
        }
        Ok(TokenRanking {
            ids,
            n_vocab: Some(vocab),
            checks,
            origin: origin.into(),
        })
    }

    /// The binary form of this ranking (see [`parse_binary`](Self::parse_binary)).
    pub fn to_binary(&self, n_vocab: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(20 + self.ids.len() * 4);
        out.extend_from_slice(RANKING_MAGIC);
        out.extend_from_slice(&(n_vocab as u32).to_le_bytes());
        out.extend_from_slice(&(self.ids.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.checks.len() as u32).to_le_bytes());
        for (id, text) in &self.checks {
            let t = &text.as_bytes()[..text.len().min(u16::MAX as usize)];
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&(t.len() as u16).to_le_bytes());
            out.extend_from_slice(t);
        }
        for id in &self.ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    /// The `n` draft tokens: every id in `always` (control tokens the model may emit), then the
    /// ranking in order, then unranked ids in id order, until there are `n`. Returned ascending.
    pub fn draft_vocab(
        &self,
        n: usize,
        n_vocab: usize,
        always: &[u32],
    ) -> Result<Vec<u32>, RankingError> {
        if n == 0 || n > n_vocab {
            return Err(RankingError::BadSize { n, n_vocab });
        }
        let mut picked = vec![false; n_vocab];
        let mut out = Vec::with_capacity(n);
        let candidates = always
            .iter()
            .chain(&self.ids)
            .copied()
            .chain(0..n_vocab as u32);
        for id in candidates {
            if out.len() >= n.max(always.len().min(n_vocab)) {
                break;
            }
            if let Some(p) = picked.get_mut(id as usize) {
                if !*p {
                    *p = true;
                    out.push(id);
                }
            }
        }
        out.sort_unstable();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_ranking_parses_and_rejects_bad_lines() {
        let r = TokenRanking::parse_text("# header\n5 100\n2 50\n\n7\n", "r.txt", 10).unwrap();
        assert_eq!(r.ids, vec![5, 2, 7]);
        let e = TokenRanking::parse_text("5 100\nx 3\n", "r.txt", 10).unwrap_err();
        assert_eq!(
            e.to_string(),
            "token ranking r.txt, line 2: 'x' is not a token id"
        );
        let e = TokenRanking::parse_text("5 100\n12 3\n", "r.txt", 10).unwrap_err();
        assert!(
            e.to_string()
                .contains("token id 12 (line 2) is out of range"),
            "{e}"
        );
        let e = TokenRanking::parse_text("5 1\n5 1\n", "r.txt", 10).unwrap_err();
        assert!(
            e.to_string().contains("line 2: token id 5 is listed twice"),
            "{e}"
        );
        assert!(TokenRanking::parse_text("# only a comment\n", "r.txt", 10).is_err());
    }

    #[test]
    fn binary_ranking_round_trips_and_rejects_truncation() {
        let r = TokenRanking {
            ids: vec![9, 3, 4],
            n_vocab: Some(10),
            checks: vec![(3, "Ġthe".into())],
            origin: "x".into(),
        };
        let b = r.to_binary(10);
        let back = TokenRanking::parse(&b, "x.bin", 10).unwrap();
        assert_eq!(back.ids, r.ids);
        assert_eq!(back.checks, r.checks);
        assert_eq!(back.n_vocab, Some(10));
        let e = TokenRanking::parse(&b[..b.len() - 2], "x.bin", 10).unwrap_err();
        assert!(e.to_string().contains("truncated at byte offset"), "{e}");
        assert!(TokenRanking::parse(&b, "x.bin", 5).is_err());
    }

    #[test]
    fn draft_vocab_takes_always_then_ranking_then_id_order() {
        let r = TokenRanking::parse_text("7\n2\n", "r", 10).unwrap();
        assert_eq!(r.draft_vocab(4, 10, &[9]).unwrap(), vec![0, 2, 7, 9]);
        assert_eq!(r.draft_vocab(1, 10, &[]).unwrap(), vec![7]);
        assert_eq!(
            r.draft_vocab(10, 10, &[]).unwrap(),
            (0..10).collect::<Vec<_>>()
        );
        assert!(matches!(
            r.draft_vocab(0, 10, &[]),
            Err(RankingError::BadSize { .. })
        ));
        assert!(matches!(
            r.draft_vocab(11, 10, &[]),
            Err(RankingError::BadSize { .. })
        ));
    }

    /// The trimmed head against the full one on the bundled tiny model.
    mod head {
        use std::sync::Arc;

        use nextn_gguf::GgufFile;
        use nextn_quant::kernels::ThreadPool;

        use crate::{KvType, LogitRows, Model, NextnHead};

        fn tiny() -> Model {
            let path = nextn_testdata::bundled_model();
            let file = Arc::new(GgufFile::open(path).expect("bundled tiny model"));
            Model::load(file).expect("tiny model loads")
        }

        /// Teacher-forced head logits for a few rows (the target's hidden states as inputs).
        fn head_logits(model: &Model, head: &NextnHead, pool: &ThreadPool) -> Vec<f32> {
            let tokens = [1u32, 17, 400, 33, 2047, 5, 8000, 12];
            let mut st = model.new_sequence(64, KvType::F32, KvType::F32).unwrap();
            let out = model
                .forward(&tokens, &mut st, LogitRows::None, pool)
                .unwrap();
            let e = model.config.n_embd;
            let mut prev = vec![0.0f32; e];
            prev.extend_from_slice(&out.hidden[..(tokens.len() - 1) * e]);
            let mut cache = head.new_cache(KvType::F32, KvType::F32, 64).unwrap();
            let d = head
                .forward(&tokens, &prev, 0, &mut cache, LogitRows::All, pool)
                .unwrap();
            assert_eq!(d.n_vocab, model.n_vocab);
            assert_eq!(d.logits.len(), tokens.len() * model.n_vocab);
            d.logits
        }

        fn check_subset(model: &Model, full: &[f32], ids: &[u32], pool: &ThreadPool) {
            let mut head = NextnHead::load(model).unwrap();
            head.restrict_vocab(ids).unwrap();
            let kept: std::collections::BTreeSet<u32> = ids.iter().copied().collect();
            assert_eq!(head.draft_vocab_size(), kept.len());
            let trimmed = head_logits(model, &head, pool);
            let v = model.n_vocab;
            for (i, (&a, &b)) in trimmed.iter().zip(full).enumerate() {
                if kept.contains(&((i % v) as u32)) {
                    assert_eq!(a.to_bits(), b.to_bits(), "row {} token {}", i / v, i % v);
                } else {
                    assert_eq!(a, f32::NEG_INFINITY, "row {} token {}", i / v, i % v);
                }
            }
        }

        #[test]
        fn restricted_logits_equal_full_logits_on_kept_ids_and_are_neg_inf_elsewhere() {
            let model = tiny();
            let pool = ThreadPool::new(2);
            let head = NextnHead::load(&model).unwrap();
            assert_eq!(head.draft_vocab_size(), model.n_vocab);
            let full = head_logits(&model, &head, &pool);
            // Scattered ids: gathered rows (a byte copy).
            let scattered: Vec<u32> = (0..model.n_vocab as u32)
                .filter(|i| i % 7 == 3 || i % 11 == 0)
                .collect();
            check_subset(&model, &full, &scattered, &pool);
            // A prefix 0..N: a zero-copy sub-slice of the mapped matrix.
            let prefix: Vec<u32> = (0..1024).rev().collect();
            let mut h = NextnHead::load(&model).unwrap();
            h.restrict_vocab(&prefix).unwrap();
            assert!(h.draft_vocab().unwrap().is_prefix());
            check_subset(&model, &full, &prefix, &pool);
            // A single token, and the last one.
            check_subset(&model, &full, &[model.n_vocab as u32 - 1], &pool);
        }

        #[test]
        fn restricting_to_the_whole_vocabulary_gives_identical_logits() {
            let model = tiny();
            let pool = ThreadPool::new(1);
            let mut head = NextnHead::load(&model).unwrap();
            let full = head_logits(&model, &head, &pool);
            let all: Vec<u32> = (0..model.n_vocab as u32).collect();
            head.restrict_vocab(&all).unwrap();
            let same = head_logits(&model, &head, &pool);
            assert!(full
                .iter()
                .zip(&same)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            head.clear_draft_vocab();
            assert_eq!(head.draft_vocab_size(), model.n_vocab);
        }

        #[test]
        fn out_of_range_or_empty_draft_vocab_is_an_error() {
            let model = tiny();
            let mut head = NextnHead::load(&model).unwrap();
            assert!(head.restrict_vocab(&[]).is_err());
            let e = head.restrict_vocab(&[3, model.n_vocab as u32]).unwrap_err();
            assert!(e.to_string().contains("out of range"), "{e}");
            assert!(head.draft_vocab().is_none());
        }
    }
}
