//! relay-dispatcher
