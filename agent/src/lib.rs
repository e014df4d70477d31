//! relay agent.
pub mod coverage;
