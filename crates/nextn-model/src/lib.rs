//! The Qwen3.5 model.
