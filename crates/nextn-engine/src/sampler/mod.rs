//! sampler: owned by a helper, in progress.
