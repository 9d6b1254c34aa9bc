//! chat: owned by a helper, in progress.
