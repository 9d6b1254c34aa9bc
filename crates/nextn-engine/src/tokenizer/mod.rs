//! tokenizer: owned by a helper, in progress.
