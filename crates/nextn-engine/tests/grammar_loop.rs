//! Constrained decoding through the generation loop: under a grammar, drafting (masked or not)
//! gives exactly plain constrained decoding's tokens, greedy and seeded; drafts drawn from the
//! head stay inside the grammar; constrained and free requests share steps without affecting each
//! other; log probabilities do not depend on drafting.

mod common;

use common::{constrained_reference, generate_jobs, Job, Loaded, Setup};
use nextn_engine::grammar::{Constraint, GrammarCompiler, GrammarSource, ReasoningBudget};
use nextn_engine::output::{FinishReason, GrammarEnd};
use nextn_engine::sampler::{SamplerConfig, TokenLogprob};
use nextn_engine::speculative::DraftSampling;
use serde_json::{json, Value};

fn schema() -> Value {
    json!({
        "type": "array", "minItems": 3, "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "size": {"type": "integer", "minimum": 0, "maximum": 99},
                "kind": {"enum": ["list", "dict", "set"]},
                "ok": {"type": "boolean"}
            },
            "required": ["name", "size", "kind", "ok"],
            "additionalProperties": false
        }
    })
}

/// The schema above, checked by hand.
fn satisfies_schema(text: &str) -> bool {
    let Ok(Value::Array(items)) = serde_json::from_str::<Value>(text) else {
        return false;
    };
    items.len() == 3
        && items.iter().all(|it| {
            let Some(o) = it.as_object() else {
                return false;
            };
            o.len() == 4
                && o["name"].as_str().is_some_and(|s| s.chars().count() <= 12)
                && o["size"].as_u64().is_some_and(|n| n <= 99)
                && ["list", "dict", "set"].contains(&o["kind"].as_str().unwrap_or(""))
                && o["ok"].is_boolean()
        })
}

const GBNF: &str = r#"root ::= "def " name "(" params "):\n    return " name "\n"
name ::= [a-z_] [a-z_0-9]{0,15}
params ::= (name (", " name){0,3})?
"#;

fn sources() -> Vec<(&'static str, GrammarSource, &'static str)> {
    vec![
        (
            "schema",
            GrammarSource::JsonSchema(schema()),
            "# three records as JSON\ndata = ",
        ),
        ("gbnf", GrammarSource::Grammar(GBNF.into()), "import os\n\n"),
        (
            "lark",
            GrammarSource::Grammar("start: /[a-z]+( [a-z]+){2,30}\\./".into()),
            "The quick brown fox",
        ),
    ]
}

fn constraint(l: &Loaded, source: &GrammarSource) -> Constraint {
    GrammarCompiler::new(&l.tok, l.model.n_vocab)
        .expect("compiler")
        .compile(source)
        .expect("the grammar compiles")
}

fn seeded(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.9,
        seed,
        ..SamplerConfig::default()
    }
}

/// Room for a schema's output: with this model's tokenizer every space of JSON indentation is a
/// token of its own.
const N_CTX: usize = 2560;

fn plain() -> Setup {
    Setup {
        n_ctx: N_CTX,
        ..Setup::plain()
    }
}

fn drafting(n_max: usize, mask_drafts: bool, sampling: DraftSampling) -> Setup {
    let mut s = Setup {
        n_ctx: N_CTX,
        ..Setup::drafting(n_max)
    };
    let spec = s.spec.as_mut().expect("drafting");
    spec.mask_drafts = mask_drafts;
    spec.draft_sampling = sampling;
    s
}

/// Tokens per request: enough for the grammars below to complete.
const N: usize = 2000;

/// Greedy and seeded (coupled), with masked and unmasked drafts, the loop emits plain
/// constrained decoding's tokens; masking the drafts keeps more of them.
#[test]
fn drafting_under_a_grammar_gives_plain_constrained_decoding() {
    let l = common::bundled(2);
    for (name, source, prompt) in sources() {
        let prompt = l.tok.encode(prompt, true);
        for sampler in [SamplerConfig::greedy(), seeded(3)] {
            let want = constrained_reference(
                &l,
                &prompt,
                &sampler,
                N,
                &plain(),
                Some(constraint(&l, &source)),
            );
            let mut accepted = Vec::new();
            for (label, setup) in [
                ("plain", plain()),
                ("masked", drafting(3, true, DraftSampling::Coupled)),
                ("unmasked", drafting(3, false, DraftSampling::Coupled)),
                ("masked n_max 1", drafting(1, true, DraftSampling::Coupled)),
            ] {
                let job = Job {
                    cache_points: Vec::new(),
                    prompt: prompt.clone(),
                    sampler: sampler.clone(),
                    n: N,
                    grammar: Some(constraint(&l, &source)),
                    logprobs: None,
                };
                let (c, _) = generate_jobs(&l, &setup, 1, vec![job]).remove(0);
                let ctx = format!("{name}, {label}, seed {}", sampler.seed);
                assert_eq!(c.tokens, want.tokens, "{ctx}");
                assert_eq!(c.finish, want.finish, "{ctx}");
                assert!(c.grammar_masks.is_some_and(|(_, n)| n > 0), "{ctx}");
                accepted.push(c.spec.draft_n_accepted);
            }
            if name == "schema" {
                let text = l.tok.decode(&want.tokens);
                assert_eq!(want.finish, FinishReason::Stop, "{text}");
                assert!(satisfies_schema(&text), "{text}");
                // On a schema the head alone proposes what the grammar forbids.
                assert!(
                    accepted[1] > accepted[2],
                    "masked {} vs unmasked {} accepted drafts",
                    accepted[1],
                    accepted[2]
                );
            }
        }
    }
}

/// Drafts drawn from the head's masked distribution and kept with min(1, p/q) stay inside the
/// grammar, and the output completes it.
#[test]
fn sampled_drafts_stay_inside_the_grammar() {
    let l = common::bundled(2);
    let prompt = l.tok.encode("data = ", true);
    for mask_drafts in [true, false] {
        for seed in 0..6 {
            let job = Job {
                cache_points: Vec::new(),
                prompt: prompt.clone(),
                sampler: seeded(seed),
                n: N,
                grammar: Some(constraint(&l, &GrammarSource::JsonSchema(schema()))),
                logprobs: None,
            };
            let setup = drafting(3, mask_drafts, DraftSampling::Sample);
            let (c, _) = generate_jobs(&l, &setup, 1, vec![job]).remove(0);
            let text = l.tok.decode(&c.tokens);
            assert_eq!(c.finish, FinishReason::Stop, "seed {seed}: {text}");
            assert!(satisfies_schema(&text), "seed {seed}: {text}");
            assert!(c.spec.draft_n > 0);
        }
    }
}

/// A grammar that dead-ends after a literal of several tokens: drafting along the literal
/// reaches the dead end inside a chain, which then stops at that row, and the verify row there
/// ends the output as a dead end at a single row does (a clean stop, the same tokens as plain
/// decoding), with masked, unmasked and sampled drafts alike.
#[test]
fn a_dead_end_inside_a_draft_chain_stops_the_output_there() {
    let l = common::bundled(2);
    let source =
        GrammarSource::Grammar("start: \"    return fibonacci(n - 1)\" /[^\\s\\S]/".into());
    let prompt = l.tok.encode("def fibonacci(n):\n", true);
    let run = |setup: &Setup, sampler: &SamplerConfig| {
        let job = Job {
            cache_points: Vec::new(),
            prompt: prompt.clone(),
            sampler: sampler.clone(),
            n: 64,
            grammar: Some(constraint(&l, &source)),
            logprobs: None,
        };
        generate_jobs(&l, setup, 1, vec![job]).remove(0).0
    };
    for sampler in [SamplerConfig::greedy(), seeded(7)] {
        let want = run(&plain(), &sampler);
        assert_eq!(
            l.tok.decode(&want.tokens),
            "    return fibonacci(n - 1)",
            "seed {}",
            sampler.seed
        );
        assert!(want.tokens.len() > 4, "the literal is several tokens");
        assert_eq!(want.finish, FinishReason::Stop);
        assert_eq!(want.grammar_end, Some(GrammarEnd::DeadEnd));
        let last = prompt.len() + want.tokens.len() - 1;
        for (label, sampling, mask_drafts) in [
            ("masked", DraftSampling::Coupled, true),
            ("unmasked", DraftSampling::Coupled, false),
            ("sampled", DraftSampling::Sample, true),
        ] {
            let setup = Setup {
                trace: true,
                ..drafting(4, mask_drafts, sampling)
            };
            let c = run(&setup, &sampler);
            let ctx = format!("{label}, seed {}", sampler.seed);
            assert_eq!(c.tokens, want.tokens, "{ctx}");
            assert_eq!(c.finish, FinishReason::Stop, "{ctx}");
            assert_eq!(c.grammar_end, Some(GrammarEnd::DeadEnd), "{ctx}");
            assert!(c.spec.draft_n > 0, "{ctx}: nothing was drafted");
            if !mask_drafts {
                continue;
            }
            // A masked chain never drafts past the last token the grammar admits, and some
            // chain ran right up to it, so the row after it (the dead end) was a verify row.
            let ends = |t: &nextn_engine::speculative::StepTrace| t.n_past + t.drafts.len();
            assert!(
                c.spec.trace.iter().all(|t| ends(t) <= last),
                "{ctx}: {:?}",
                c.spec.trace
            );
            assert!(
                c.spec.trace.iter().any(|t| !t.drafts.is_empty()
                    && ends(t) == last
                    && t.accepted == t.drafts.len()),
                "{ctx}: no chain reached the dead end: {:?}",
                c.spec.trace
            );
        }
    }
}

/// Constrained and free requests in one batch each get what they get alone.
#[test]
fn constrained_and_free_requests_share_steps() {
    let l = common::bundled(2);
    let mut jobs = Vec::new();
    let mut want = Vec::new();
    for (i, (_, source, prompt)) in sources().into_iter().enumerate() {
        let prompt = l.tok.encode(prompt, true);
        let sampler = if i == 1 {
            seeded(5)
        } else {
            SamplerConfig::greedy()
        };
        want.push(
            constrained_reference(
                &l,
                &prompt,
                &sampler,
                N,
                &plain(),
                Some(constraint(&l, &source)),
            )
            .tokens,
        );
        jobs.push(Job {
            cache_points: Vec::new(),
            prompt,
            sampler,
            n: N,
            grammar: Some(constraint(&l, &source)),
            logprobs: None,
        });
    }
    let free = l.tok.encode("import os\nimport sys\n", true);
    want.push(constrained_reference(&l, &free, &seeded(9), 40, &plain(), None).tokens);
    jobs.push(Job {
        cache_points: Vec::new(),
        prompt: free,
        sampler: seeded(9),
        n: 40,
        grammar: None,
        logprobs: None,
    });
    let got = generate_jobs(&l, &drafting(3, true, DraftSampling::Coupled), 4, jobs);
    for (i, ((c, _), w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(&c.tokens, w, "request {i}");
    }
    assert!(got[3].0.grammar_masks.is_none());
}

/// Every output token gets the log probability of the model's raw row and its most likely
/// alternatives, the same with or without drafting (and with a grammar masking the draws).
#[test]
fn log_probabilities_do_not_depend_on_drafting() {
    let l = common::bundled(2);
    for (grammar, prompt) in [
        (None, "class Stack:\n"),
        (Some(GrammarSource::JsonSchema(schema())), "data = "),
    ] {
        let prompt = l.tok.encode(prompt, true);
        let reference = constrained_reference(
            &l,
            &prompt,
            &seeded(4),
            48,
            &plain(),
            grammar.as_ref().map(|g| constraint(&l, g)),
        );
        let want: Vec<TokenLogprob> = reference
            .tokens
            .iter()
            .zip(&reference.rows)
            .map(|(&t, row)| TokenLogprob::of(row, t, 5))
            .collect();
        for setup in [plain(), drafting(3, true, DraftSampling::Coupled)] {
            let job = Job {
                cache_points: Vec::new(),
                prompt: prompt.clone(),
                sampler: seeded(4),
                n: 48,
                grammar: grammar.as_ref().map(|g| constraint(&l, g)),
                logprobs: Some(5),
            };
            let (c, lps) = generate_jobs(&l, &setup, 1, vec![job]).remove(0);
            assert_eq!(c.tokens, reference.tokens);
            assert_eq!(lps.len(), want.len());
            // Verify rows equal one-row decodes bit for bit, so the numbers do too.
            for (i, (got, want)) in lps.iter().zip(&want).enumerate() {
                assert_eq!(got, want, "token {i}");
                assert_eq!(got.top.len(), 5);
            }
        }
    }
}

/// A reasoning budget: the block the prompt opened takes exactly `budget` of the model's own
/// tokens, then the closing sequence; drafting (masked, unmasked, one deep) gives the same tokens
/// as plain decoding under the budget, greedy and seeded, and forced tokens are drafted.
#[test]
fn a_reasoning_budget_closes_the_block_with_and_without_drafting() {
    let l = common::bundled(2);
    let prompt = l.tok.encode("<think>\ndef parse(line):", true);
    const BUDGET: usize = 24;
    let budget = || {
        ReasoningBudget::from_tags(
            &l.tok,
            BUDGET,
            true,
            "<think>",
            "</think>",
            " Enough thinking, the answer:",
        )
    };
    let forced = l.tok.encode(" Enough thinking, the answer:</think>", true);
    let compiler = GrammarCompiler::new(&l.tok, l.model.n_vocab).expect("compiler");
    let n = 120;
    for sampler in [SamplerConfig::greedy(), seeded(3)] {
        let free = constrained_reference(&l, &prompt, &sampler, n, &plain(), None);
        let want = constrained_reference(
            &l,
            &prompt,
            &sampler,
            n,
            &plain(),
            Some(compiler.reasoning_budget_only(budget())),
        );
        // The model's own tokens up to the budget, then the closing sequence.
        assert_eq!(want.tokens[..BUDGET], free.tokens[..BUDGET]);
        assert_eq!(want.tokens[BUDGET..BUDGET + forced.len()], forced[..]);
        assert_ne!(want.tokens, free.tokens, "the budget changed nothing");
        for (label, setup) in [
            ("plain", plain()),
            ("masked", drafting(3, true, DraftSampling::Coupled)),
            ("unmasked", drafting(3, false, DraftSampling::Coupled)),
            ("masked n_max 1", drafting(1, true, DraftSampling::Coupled)),
        ] {
            let job = Job {
                cache_points: Vec::new(),
                prompt: prompt.clone(),
                sampler: sampler.clone(),
                n,
                grammar: Some(compiler.reasoning_budget_only(budget())),
                logprobs: None,
            };
            let (c, _) = generate_jobs(&l, &setup, 1, vec![job]).remove(0);
            let ctx = format!("{label}, seed {}", sampler.seed);
            assert_eq!(c.tokens, want.tokens, "{ctx}");
            assert_eq!(c.finish, want.finish, "{ctx}");
            // No grammar: no grammar masks are reported.
            assert!(c.grammar_masks.is_none(), "{ctx}");
            if label == "masked" && sampler.is_greedy() {
                assert!(
                    c.spec.draft_n_accepted >= forced.len() as u64 / 2,
                    "{ctx}: {} drafts accepted",
                    c.spec.draft_n_accepted
                );
            }
        }
    }
}

/// A budget beside a grammar: while the output does not open a reasoning block, the budget
/// changes nothing.
#[test]
fn a_reasoning_budget_outside_a_block_leaves_the_grammar_alone() {
    let l = common::bundled(2);
    let (_, source, prompt) = sources().remove(1);
    let prompt = l.tok.encode(prompt, true);
    let want = constrained_reference(
        &l,
        &prompt,
        &SamplerConfig::greedy(),
        N,
        &plain(),
        Some(constraint(&l, &source)),
    );
    let budget = ReasoningBudget::from_tags(&l.tok, 0, false, "<think>", "</think>", "");
    let job = Job {
        cache_points: Vec::new(),
        prompt,
        sampler: SamplerConfig::greedy(),
        n: N,
        grammar: Some(constraint(&l, &source).with_reasoning_budget(budget)),
        logprobs: None,
    };
    let setup = drafting(3, true, DraftSampling::Coupled);
    let (c, _) = generate_jobs(&l, &setup, 1, vec![job]).remove(0);
    assert_eq!(c.tokens, want.tokens);
    assert_eq!(c.finish, FinishReason::Stop);
}
