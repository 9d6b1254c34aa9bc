//! Everything between token ids and text: tokenizer, chat template, sampler, generation loops.

pub mod chat;
pub mod generate;
pub mod sampler;
pub mod scheduler;
pub mod speculative;
pub mod tokenizer;
