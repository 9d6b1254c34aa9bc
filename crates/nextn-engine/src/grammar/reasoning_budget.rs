//! A cap on the tokens of a reasoning block, as llama.cpp's `--reasoning-budget` sampler: once
//! the block has taken `budget` tokens, the next ones are forced to a closing sequence (an
//! optional message, then the closing tag) and the model answers from there.
//!
//! The state is a function of the output tokens alone, one phase per token kept, so that drafting
//! can advance a copy along the draft chain, verification can check every row against the state
//! after the tokens before it, and the drafts the target rejects are undone exactly: the same
//! output with drafting as without.

use crate::tokenizer::Tokenizer;

/// Where the output stands with respect to the reasoning block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Not inside a reasoning block: watching for the opening tag.
    Outside,
    /// Inside the block, `used` of its tokens so far.
    Thinking { used: usize },
    /// The budget ran out: the closing sequence's token `next` comes next.
    Forcing { next: usize },
    /// The block was closed (by the model or by force): the budget is spent for this output.
    Closed,
}

/// One output's reasoning budget.
#[derive(Clone, Debug)]
pub struct ReasoningBudget {
    budget: usize,
    /// The opening tag's tokens (`<think>`).
    open: Vec<u32>,
    /// The closing tag's tokens (`</think>`): the model closing the block itself ends the count.
    close: Vec<u32>,
    /// What is forced when the budget runs out: the message, then the closing tag.
    forced: Vec<u32>,
    /// The output tokens taken so far, for matching tags across token boundaries.
    tokens: Vec<u32>,
    /// The phase before any output token, then after each token taken.
    phases: Vec<Phase>,
}

impl ReasoningBudget {
    /// At most `budget` tokens of reasoning. `in_reasoning`: the prompt already opened the block
    /// (templates with thinking on end the generation prompt with `<think>\n`). `forced` is the
    /// sequence written when the budget runs out and must end with `close`.
    pub fn new(
        budget: usize,
        in_reasoning: bool,
        open: Vec<u32>,
        close: Vec<u32>,
        forced: Vec<u32>,
    ) -> Self {
        let start = if in_reasoning {
            Self::thinking(budget, 0)
        } else {
            Phase::Outside
        };
        ReasoningBudget {
            budget,
            open,
            close,
            forced,
            tokens: Vec::new(),
            phases: vec![start],
        }
    }

    /// The budget for a reasoning block written between the tags `open` and `close`, with
    /// `message` written before `close` when the budget runs out (llama.cpp's
    /// `--reasoning-budget-message`), all tokenized by `tokenizer` (control tokens such as
    /// `<think>` become their ids).
    pub fn from_tags(
        tokenizer: &Tokenizer,
        budget: usize,
        in_reasoning: bool,
        open: &str,
        close: &str,
        message: &str,
    ) -> Self {
        ReasoningBudget::new(
            budget,
            in_reasoning,
            tokenizer.encode(open, true),
            tokenizer.encode(close, true),
            tokenizer.encode(&format!("{message}{close}"), true),
        )
    }

    fn thinking(budget: usize, used: usize) -> Phase {
        if used >= budget {
            Phase::Forcing { next: 0 }
        } else {
            Phase::Thinking { used }
        }
    }

    fn phase(&self) -> Phase {
        *self
            .phases
            .last()
            .expect("the phase before any token is kept")
    }

    /// The token that must come next, when the budget forces one.
    pub fn forced_token(&self) -> Option<u32> {
        match self.phase() {
            Phase::Forcing { next } => self.forced.get(next).copied(),
            _ => None,
        }
    }

    /// Whether the output is inside its reasoning block (before the closing tag).
    pub fn in_reasoning(&self) -> bool {
        matches!(self.phase(), Phase::Thinking { .. } | Phase::Forcing { .. })
    }

    /// `token` comes next in the output.
    pub fn consume(&mut self, token: u32) {
        self.tokens.push(token);
        let ends_with = |tag: &[u32]| !tag.is_empty() && self.tokens.ends_with(tag);
        let next = match self.phase() {
            Phase::Outside if ends_with(&self.open) => Self::thinking(self.budget, 0),
            Phase::Outside => Phase::Outside,
            Phase::Thinking { .. } if ends_with(&self.close) => Phase::Closed,
            Phase::Thinking { used } => Self::thinking(self.budget, used + 1),
            Phase::Forcing { next } if next + 1 >= self.forced.len() => Phase::Closed,
            Phase::Forcing { next } => Phase::Forcing { next: next + 1 },
            Phase::Closed => Phase::Closed,
        };
        self.phases.push(next);
    }

    /// Undo the last `n` tokens taken (drafts the target did not keep).
    pub fn rollback(&mut self, n: usize) {
        let n = n.min(self.tokens.len());
        self.tokens.truncate(self.tokens.len() - n);
        self.phases.truncate(self.phases.len() - n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: u32 = 10;
    const CLOSE: u32 = 11;
    const MSG: u32 = 12;

    fn budget(n: usize, in_reasoning: bool) -> ReasoningBudget {
        ReasoningBudget::new(n, in_reasoning, vec![OPEN], vec![CLOSE], vec![MSG, CLOSE])
    }

    /// Feed the output a model would write (`free` tokens where nothing is forced) and return
    /// what the budget lets through.
    fn run(b: &mut ReasoningBudget, free: &[u32], len: usize) -> Vec<u32> {
        let mut free = free.iter().copied();
        let mut out = Vec::new();
        while out.len() < len {
            let t = match b.forced_token() {
                Some(t) => t,
                None => match free.next() {
                    Some(t) => t,
                    None => break,
                },
            };
            b.consume(t);
            out.push(t);
        }
        out
    }

    #[test]
    fn a_block_opened_by_the_prompt_is_closed_after_the_budget() {
        let mut b = budget(3, true);
        assert!(b.in_reasoning());
        let out = run(&mut b, &[1, 2, 3, 4, 5, 6], 8);
        assert_eq!(out, [1, 2, 3, MSG, CLOSE, 4, 5, 6]);
        assert!(!b.in_reasoning());
    }

    #[test]
    fn a_block_opened_in_the_output_counts_from_its_tag() {
        let mut b = budget(2, false);
        let out = run(&mut b, &[1, OPEN, 2, 3, 4, OPEN, 5, 6, 7], 20);
        // The second block comes after the budget was spent on the first: not counted again.
        assert_eq!(out, [1, OPEN, 2, 3, MSG, CLOSE, 4, OPEN, 5, 6, 7]);
    }

    #[test]
    fn a_model_that_closes_in_time_is_left_alone() {
        let mut b = budget(3, true);
        let out = run(&mut b, &[1, 2, CLOSE, 4, 5, 6, 7], 7);
        assert_eq!(out, [1, 2, CLOSE, 4, 5, 6, 7]);
    }

    #[test]
    fn budget_zero_forces_the_close_at_once() {
        let b = budget(0, true);
        assert_eq!(b.forced_token(), Some(MSG));
        let mut b = budget(0, false);
        assert_eq!(b.forced_token(), None);
        b.consume(OPEN);
        assert_eq!(b.forced_token(), Some(MSG));
    }

    #[test]
    fn tags_of_several_tokens_match_across_tokens() {
        let mut b = ReasoningBudget::new(1, false, vec![7, 8], vec![9, 9], vec![9, 9]);
        for t in [7, 1, 7, 8] {
            assert_eq!(b.forced_token(), None);
            b.consume(t);
        }
        assert!(b.in_reasoning());
        b.consume(1);
        assert_eq!(b.forced_token(), Some(9));
    }

    #[test]
    fn rollback_returns_to_the_state_before_the_undone_tokens() {
        let mut b = budget(2, true);
        b.consume(1);
        let before = (b.forced_token(), b.in_reasoning(), b.tokens.clone());
        b.consume(2);
        assert_eq!(b.forced_token(), Some(MSG));
        b.consume(MSG);
        b.consume(CLOSE);
        assert!(!b.in_reasoning());
        b.rollback(3);
        assert_eq!(
            (b.forced_token(), b.in_reasoning(), b.tokens.clone()),
            before
        );
        // And the same tokens again give the same states.
        b.consume(2);
        assert_eq!(b.forced_token(), Some(MSG));
    }
}
