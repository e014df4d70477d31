//! The simulated-fleet load tester behind `relay-fleet run` and `relay-fleet bench`.
//!
//! - `scenario`: scenario files (TOML) and the embedded built-ins; validation.
//! - `runner`: sets up the fleet (embedded, or simulated agents against an external
//!   deployment), sends the load, injects faults, samples once a second.
//! - `report`: figures, headline expectations, the terminal summary and the JSON form.
//! - `html`: the self-contained HTML report with inline SVG charts.
//! - `bench`: direct-to-upstream vs relayed calls/s and latency.
//! - `neighbours`: one tenant's calls alone and beside another tenant's burst.
//! - `idle`: what idle agent streams cost one tunnel server (memory and CPU).
//!
//! Nothing here prints to stdout; the binary decides what to show.

pub mod bench;
pub mod html;
pub mod idle;
pub mod neighbours;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod worker;

pub use report::Report;
pub use runner::{run, Mode, RunOptions};
pub use scenario::Scenario;
