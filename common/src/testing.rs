//! Helpers for the crates' own tests (feature `test-util`): waiting for a condition with a
//! deadline, never for a fixed time. Not part of any binary.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Polls until every address refuses TCP connections (its listener is closed); panics
/// naming the address if one still accepts after `within`.
pub async fn until_refused(addrs: &[SocketAddr], within: Duration) {
    let deadline = Instant::now() + within;
    for addr in addrs {
        while TcpStream::connect(addr).await.is_ok() {
            assert!(
                Instant::now() < deadline,
                "{addr} still accepts connections"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Polls `cond` every few milliseconds until it holds; panics naming `what` if it does not
/// within `within`.
pub async fn until(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
