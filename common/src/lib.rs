//! Pieces every relay binary shares: the admin HTTP listener (`/metrics`, `/healthz`,
//! `/readyz` and binary-specific routes), the status pages' HTML (`html`: layout, tables,
//! escaping), TOML config loading with errors that name the key, the `Secret` newtype, the
//! tokio runtime, shutdown signals and tracing setup.
//!
//! Nothing here knows about tunnels or calls; it must stay free of product logic.

pub mod admin;
pub mod config;
#[cfg(any(test, feature = "dev-certs"))]
pub mod devcerts;
pub mod diag;
pub mod glob;
pub mod grpc;
pub mod h2;
pub mod h2io;
pub mod hop;
pub mod hosts;
pub mod html;
pub mod listen;
pub mod peer;
pub mod rtt;
pub mod runtime;
pub mod secret;
pub mod server_id;
pub mod shutdown;
pub mod socket;
pub mod telemetry;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod tls;
pub mod trace;
pub mod tunnel_id;
pub mod wall;

pub use secret::{KeyDigest, Secret};
