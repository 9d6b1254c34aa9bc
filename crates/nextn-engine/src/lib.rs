//! Everything between token ids and text: tokenizer, chat template, sampler, and the one
//! generation loop (the scheduler) with its speculative parts.

pub mod chat;
pub mod grammar;
pub mod media;
pub mod output;
pub mod prefix_cache;
pub mod sampler;
pub mod scheduler;
pub mod slot_file;
pub mod speculative;
pub mod tokenizer;
