//! What the three relay binaries share, so that each rule of the relay's edges is written
//! once:
//!
//! - **Process plumbing**: TOML config loading with errors that name the key and the flag
//!   overrides over it (`config`), the `Secret` newtype (`secret`), the tokio runtime
//!   (`runtime`), shutdown signals (`shutdown`), tracing setup (`telemetry`), the wall
//!   clock (`wall`) and the support archive (`diag`).
//! - **Serving and dialing**: the admin HTTP listener and the status pages' HTML (`admin`,
//!   `html`), accepting connections under limits (`listen`, `socket`), TLS for every hop
//!   (`tls`), HTTP/2 limits, sockets and gRPC endpoints (`h2`, `h2io`, `grpc`, `peer`),
//!   and the samples of collectors built at scrape time (`scraped`).
//! - **The relay's shared vocabulary**: the rules both ends of a hop must agree on, kept
//!   here so no binary depends on another: tunnel ids and server ids as every process
//!   checks them (`tunnel_id`, `server_id`), hop-by-hop header rules (`hop`), host rules
//!   for peer-supplied URLs (`hosts`), the one wildcard (`glob`) and the smoothed round-trip
//!   time (`rtt`). The listener's limits count per tunnel id (`listen`).
//!
//! What must not live here: a component's decisions. Which stream takes a call, how an
//! agent sizes its pool, where a dispatcher routes, what a call's outcome is: those stay in
//! the binary that makes them. This crate knows names and limits, never a call's course.

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
pub mod outbox;
pub mod peer;
pub mod rtt;
pub mod runtime;
pub mod scraped;
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
