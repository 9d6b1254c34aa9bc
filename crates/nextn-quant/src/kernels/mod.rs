//! Kernels: see the helper that owns this module.
