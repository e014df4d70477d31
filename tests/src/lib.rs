//! relay-tests
