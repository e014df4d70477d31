//! Coverage: the sizing tick over per-server stream coverage.
pub mod plan;
