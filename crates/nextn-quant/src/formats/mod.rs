//! Block formats: see the helper that owns this module.
