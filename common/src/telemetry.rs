//! Tracing setup shared by the binaries: `RELAY_LOG` (or `RUST_LOG`) sets the filter,
//! `RELAY_LOG_FORMAT=json` switches to JSON lines. Logs go to stderr (stdout stays for what
//! a command prints, such as a report or a token), coloured only when stderr is a terminal.

use tracing_subscriber::EnvFilter;

pub fn init(default_filter: &str) {
    let filter = std::env::var("RELAY_LOG")
        .ok()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| default_filter.to_string());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new(default_filter));
    let json = std::env::var("RELAY_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
