//! Pieces every relay binary shares: the admin HTTP listener (`/metrics`, `/healthz`,
//! `/readyz` and binary-specific routes), TOML config loading with errors that name the
//! key, the `Secret` newtype, shutdown signals and tracing setup.
//!
//! Nothing here knows about tunnels or calls; it must stay free of product logic.

pub mod admin;
pub mod config;
pub mod secret;
pub mod shutdown;
pub mod telemetry;

pub use secret::Secret;
