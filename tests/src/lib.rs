//! relay's end-to-end harness: the whole stack on loopback (`stack`), a backend client
//! (`client`), the stream-placing load-balancer fixture (`lb`) and simulated upstreams
//! (`upstream`), and generated TLS sets (`certs`). The `relay-fleet` binary (demo and load tester) is built on it.

pub mod certs;
pub mod client;
pub mod fleet;
pub mod haproxy;
pub mod lb;
pub mod metrics;
pub mod procs;
pub mod stack;
pub mod upstream;
