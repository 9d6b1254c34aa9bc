//! Constrained decoding: a request's grammar (a JSON schema, any JSON object, a Lark or GBNF
//! grammar, a regular expression) compiled with llguidance into a matcher that says, at every
//! output position, which tokens keep the output inside the grammar.
//!
//! The generation loop masks the target's rows with it and, so that drafts stay inside the
//! grammar and acceptance does not collapse, the NextN head's draft rows too: a copy of the
//! matcher's state advances along the draft chain and is rolled back afterwards.
//!
//! A reasoning budget ([`ReasoningBudget`]) constrains the output the same way: where it forces
//! the closing sequence, the mask allows that one token.

mod gbnf;
mod reasoning_budget;

use std::sync::Arc;
use std::time::Instant;

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

pub use gbnf::{gbnf_to_lark, looks_like_gbnf, GbnfError};
pub use reasoning_budget::ReasoningBudget;

use crate::sampler::TokenMask;
use crate::tokenizer::Tokenizer;

/// A grammar as a request gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSource {
    /// Output must be JSON valid under this schema.
    JsonSchema(Value),
    /// Output must be a JSON object.
    JsonObject,
    /// A grammar in llguidance's Lark syntax, or llama.cpp's GBNF (recognised by its `::=`).
    Grammar(String),
    /// Output must match this regular expression.
    Regex(String),
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum GrammarError {
    #[error("the tokenizer cannot be used for constrained decoding: {0}")]
    Tokenizer(String),
    #[error(transparent)]
    Gbnf(#[from] GbnfError),
    #[error("the {what} does not compile: {message}")]
    Compile { what: &'static str, message: String },
    #[error("the grammar's matcher failed: {0}")]
    Matcher(String),
    #[error("the grammar admits no token at this point of the output")]
    NoToken,
}

impl GrammarSource {
    fn what(&self) -> &'static str {
        match self {
            GrammarSource::JsonSchema(_) => "JSON schema",
            GrammarSource::JsonObject => "JSON object grammar",
            GrammarSource::Grammar(_) => "grammar",
            GrammarSource::Regex(_) => "regular expression",
        }
    }
}

/// Between JSON tokens at most one space, or line breaks with up to 20 characters of
/// indentation, as llama.cpp's JSON grammars allow: unbounded whitespace lets a model at a high
/// temperature pad forever instead of writing the value. A schema that sets its own
/// `x-guidance` options keeps them.
fn bounded_whitespace(mut schema: Value) -> Value {
    if let Some(m) = schema.as_object_mut() {
        m.entry("x-guidance").or_insert(serde_json::json!({
            "whitespace_flexible": false,
            "whitespace_pattern": "(?: |\\n{1,2}[ \\t]{0,20})",
        }));
    }
    schema
}

/// Compiles grammars for one tokenizer; the token trie is built once.
pub struct GrammarCompiler {
    factory: ParserFactory,
    n_vocab: usize,
    /// End-of-generation tokens.
    eog: Vec<u32>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("n_vocab", &self.n_vocab)
            .finish()
    }
}

impl GrammarCompiler {
    /// For a model whose logits rows are `n_vocab` wide (at least the tokenizer's vocabulary).
    /// Control tokens (`<|im_end|>`, ...) are special tokens a grammar can name as
    /// `<|im_end|>`; every other token stands for its bytes. End of generation: the tokenizer's
    /// end-of-turn (else end-of-sequence) token and every other end-of-generation token.
    pub fn new(tokenizer: &Tokenizer, n_vocab: usize) -> Result<Self, GrammarError> {
        let n_vocab = n_vocab.max(tokenizer.vocab_size());
        let words: Vec<Vec<u8>> = (0..n_vocab as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id);
                if tokenizer.is_control(id) && !bytes.is_empty() {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(bytes);
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let eos = tokenizer
            .eot()
            .or(tokenizer.eos())
            .or_else(|| tokenizer.eog_ids().first().copied())
            .ok_or_else(|| GrammarError::Tokenizer("it has no end-of-generation token".into()))?;
        let mut info = TokRxInfo::new(n_vocab as u32, eos);
        info.tok_end_of_turn = tokenizer.eot();
        let mut eog: Vec<u32> = vec![eos];
        eog.extend(tokenizer.eog_ids().iter().filter(|&&t| t != eos));
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            n_vocab,
            eog,
        })
    }

    /// A fresh matcher for one request's output.
    pub fn compile(&self, source: &GrammarSource) -> Result<Constraint, GrammarError> {
        let grammar = match source {
            GrammarSource::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(bounded_whitespace(schema.clone()))
            }
            GrammarSource::JsonObject => TopLevelGrammar::from_json_schema(bounded_whitespace(
                serde_json::json!({"type": "object"}),
            )),
            GrammarSource::Grammar(text) if looks_like_gbnf(text) => {
                TopLevelGrammar::from_lark(gbnf_to_lark(text)?)
            }
            GrammarSource::Grammar(text) => {
                let text = text.trim_start();
                TopLevelGrammar::from_lark(
                    text.strip_prefix("%llguidance").unwrap_or(text).to_string(),
                )
            }
            GrammarSource::Regex(rx) => TopLevelGrammar::from_regex(rx),
        };
        let compile_error = |e: &dyn std::fmt::Display| GrammarError::Compile {
            what: source.what(),
            message: e.to_string(),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| compile_error(&e))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(compile_error(&e));
        }
        // A grammar that admits nothing at all is refused now, not at the first token.
        let first = matcher.compute_mask().map_err(|e| compile_error(&e))?;
        if first.is_zero() {
            return Err(GrammarError::Compile {
                what: source.what(),
                message: "it admits no output".into(),
            });
        }
        Ok(Constraint {
            grammar: Some(Grammar {
                initial: matcher.clone(),
                matcher,
                taken: Vec::new(),
            }),
            budget: None,
            n_vocab: self.n_vocab,
            eog: self.eog.clone(),
            eog_after_end: 0,
            mask_ms: 0.0,
            masks: 0,
        })
    }

    /// A constraint with no grammar, only `budget` on the reasoning block.
    pub fn reasoning_budget_only(&self, budget: ReasoningBudget) -> Constraint {
        Constraint {
            grammar: None,
            budget: Some(budget),
            n_vocab: self.n_vocab,
            eog: self.eog.clone(),
            eog_after_end: 0,
            mask_ms: 0.0,
            masks: 0,
        }
    }
}

/// A grammar's matcher, with what rebuilds it after a dead end.
struct Grammar {
    matcher: Matcher,
    /// The matcher before any token, and the tokens the matcher has taken since: a dead end
    /// leaves the matcher in its error state for good, and the state before it is rebuilt from
    /// these (drafting runs into a dead end and then rolls its chain back).
    initial: Matcher,
    taken: Vec<u32>,
}

impl Grammar {
    /// The matcher as it was before the last failed mask: the initial one fed every token taken.
    fn rebuild(&mut self) -> Result<(), GrammarError> {
        let mut matcher = self.initial.clone();
        matcher
            .consume_tokens(&self.taken)
            .map_err(|e| GrammarError::Matcher(e.to_string()))?;
        self.matcher = matcher;
        Ok(())
    }
}

/// One request's constraints on its output (a grammar, a reasoning budget, or both): which
/// tokens may come next, advanced token by token.
pub struct Constraint {
    /// None when only a reasoning budget constrains the output.
    grammar: Option<Grammar>,
    budget: Option<ReasoningBudget>,
    n_vocab: usize,
    eog: Vec<u32>,
    /// End-of-generation tokens taken after the grammar was complete (the matcher does not
    /// take them; a rollback undoes them first).
    eog_after_end: usize,
    /// Time spent computing masks, and how many.
    mask_ms: f64,
    masks: u64,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.is_finished())
            .field("masks", &self.masks)
            .finish()
    }
}

impl Constraint {
    /// The same constraint with `budget` on the reasoning block as well.
    pub fn with_reasoning_budget(mut self, budget: ReasoningBudget) -> Constraint {
        self.budget = Some(budget);
        self
    }

    /// The tokens allowed next (only end-of-generation ones once the grammar is complete; only
    /// the forced one where the reasoning budget forces the closing sequence).
    pub fn mask(&mut self) -> Result<TokenMask, GrammarError> {
        let forced = self.budget.as_ref().and_then(ReasoningBudget::forced_token);
        let mask = match self.grammar.as_mut() {
            Some(g) => {
                let t = Instant::now();
                let vob = g.matcher.compute_mask_or_eos().map_err(|e| {
                    // llguidance reports a state no token continues (the output so far cannot be
                    // completed) as an error whose first line names its stop reason; the text is
                    // all the matcher keeps of it.
                    let message = e.to_string();
                    let reason = StopReason::NoExtensionBias.to_string();
                    if message.lines().next() == Some(reason.as_str()) {
                        GrammarError::NoToken
                    } else {
                        GrammarError::Matcher(message)
                    }
                });
                let vob = match vob {
                    Err(GrammarError::NoToken) => {
                        g.rebuild()?;
                        return Err(GrammarError::NoToken);
                    }
                    other => other?,
                };
                self.mask_ms += t.elapsed().as_secs_f64() * 1e3;
                self.masks += 1;
                let mask = TokenMask::from_words(vob.as_slice().to_vec(), self.n_vocab);
                match forced {
                    Some(t) if mask.allows(t) => TokenMask::only(t, self.n_vocab),
                    // The grammar does not let the block close here: the grammar is the
                    // request's contract, the budget gives way.
                    _ => mask,
                }
            }
            None => match forced {
                Some(t) => TokenMask::only(t, self.n_vocab),
                None => TokenMask::all(self.n_vocab),
            },
        };
        if mask.count() == 0 {
            return Err(GrammarError::NoToken);
        }
        Ok(mask)
    }

    /// `token` comes next in the output. Once the grammar is complete only end-of-generation
    /// tokens may follow.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        if let Some(g) = self.grammar.as_mut() {
            if g.matcher.is_stopped() && self.eog.contains(&token) {
                self.eog_after_end += 1;
            } else {
                g.matcher
                    .consume_token(token)
                    .map_err(|e| GrammarError::Matcher(e.to_string()))?;
                g.taken.push(token);
            }
        }
        // The budget advances only with tokens the grammar took, so both undo the same tokens.
        if let Some(b) = self.budget.as_mut() {
            b.consume(token);
        }
        Ok(())
    }

    /// Undo the last `n` consumed tokens (drafts the target did not keep).
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        if let Some(b) = self.budget.as_mut() {
            b.rollback(n);
        }
        let Some(g) = self.grammar.as_mut() else {
            return Ok(());
        };
        let after_end = n.min(self.eog_after_end);
        self.eog_after_end -= after_end;
        let n = n - after_end;
        if n == 0 {
            return Ok(());
        }
        g.matcher
            .rollback(n)
            .map_err(|e| GrammarError::Matcher(e.to_string()))?;
        g.taken.truncate(g.taken.len().saturating_sub(n));
        Ok(())
    }

    /// The grammar is complete and admits nothing more (known once a mask or a token showed it).
    pub fn is_finished(&self) -> bool {
        self.grammar
            .as_ref()
            .is_some_and(|g| g.matcher.is_stopped())
    }

    /// Whether `token` ends generation.
    pub fn is_eog(&self, token: u32) -> bool {
        self.eog.contains(&token)
    }

    /// With a grammar: milliseconds spent computing its masks, and how many were computed.
    pub fn mask_time(&self) -> Option<(f64, u64)> {
        self.grammar.as_ref().map(|_| (self.mask_ms, self.masks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compiler() -> (GrammarCompiler, Tokenizer) {
        let file = nextn_gguf::GgufFile::open(nextn_testdata::bundled_model()).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        (GrammarCompiler::new(&tok, 8192).unwrap(), tok)
    }

    /// Follow the grammar by always taking the first allowed token; the text produced.
    fn walk(c: &mut Constraint, tok: &Tokenizer, limit: usize) -> String {
        let mut out = Vec::new();
        for _ in 0..limit {
            if c.is_finished() {
                break;
            }
            let m = c.mask().unwrap();
            let t = m.first().unwrap();
            if tok.is_eog(t) {
                break;
            }
            c.consume(t).unwrap();
            out.push(t);
        }
        tok.decode(&out)
    }

    /// A grammar whose output cannot be completed after a point (nothing matches an empty
    /// character class) is a dead end there, not a matcher failure.
    #[test]
    fn a_dead_end_admits_no_token() {
        let (g, tok) = compiler();
        let mut c = g
            .compile(&GrammarSource::Grammar("start: \"a\" /[^\\s\\S]/".into()))
            .unwrap();
        let a = tok.encode("a", false);
        assert_eq!(a.len(), 1);
        assert!(c.mask().unwrap().allows(a[0]));
        c.consume(a[0]).unwrap();
        let m = c.mask();
        assert!(matches!(m, Err(GrammarError::NoToken)), "{m:?}");
        // The dead end leaves the state as it was: a drafted chain that ran into it rolls back,
        // and the row is a dead end again.
        assert!(!c.is_finished());
        c.rollback(1).unwrap();
        assert!(c.mask().unwrap().allows(a[0]));
        c.consume(a[0]).unwrap();
        assert!(matches!(c.mask(), Err(GrammarError::NoToken)));
    }

    #[test]
    fn a_const_schema_admits_one_string() {
        let (g, tok) = compiler();
        let mut c = g
            .compile(&GrammarSource::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": {"unit": {"const": "celsius"}},
                "required": ["unit"],
                "additionalProperties": false
            })))
            .unwrap();
        let text = walk(&mut c, &tok, 64);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v, serde_json::json!({"unit": "celsius"}));
    }

    #[test]
    fn rollback_returns_to_an_earlier_state() {
        let (g, tok) = compiler();
        let mut c = g
            .compile(&GrammarSource::Grammar("start: \"ab\" | \"cd\"".into()))
            .unwrap();
        let before = c.mask().unwrap();
        let a = tok.encode("a", false)[0];
        assert!(before.allows(a));
        c.consume(a).unwrap();
        let after = c.mask().unwrap();
        assert_ne!(before, after);
        c.rollback(1).unwrap();
        assert_eq!(c.mask().unwrap(), before);
        assert!(c.consume(tok.encode("x", false)[0]).is_err());
    }

    #[test]
    fn gbnf_lark_and_regex_compile_and_bad_ones_are_refused() {
        let (g, tok) = compiler();
        let mut c = g
            .compile(&GrammarSource::Grammar("root ::= \"yes\" | \"no\"".into()))
            .unwrap();
        let text = walk(&mut c, &tok, 8);
        assert!(text == "yes" || text == "no", "{text}");
        let mut c = g.compile(&GrammarSource::Regex("[0-9]{3}".into())).unwrap();
        assert_eq!(walk(&mut c, &tok, 8).len(), 3);
        for bad in [
            GrammarSource::Grammar("start: nothere".into()),
            GrammarSource::Grammar("root ::= (\"x\"".into()),
            GrammarSource::JsonSchema(serde_json::json!({"type": "nonsense"})),
            GrammarSource::Regex("(".into()),
        ] {
            let e = g.compile(&bad).unwrap_err();
            assert!(
                matches!(e, GrammarError::Compile { .. } | GrammarError::Gbnf(_)),
                "{bad:?}: {e}"
            );
        }
    }
}
