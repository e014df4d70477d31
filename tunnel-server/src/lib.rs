//! relay-tunnel-server
