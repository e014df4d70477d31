//! The HTTP/2 limits of every connection the relay makes or accepts, in one place.
//!
//! Each hop (the dispatcher's front, dispatcher -> tunnel server, the registry's report
//! streams, agent -> tunnel server) has its own defaults here ([`H2Limits::FRONT`],
//! [`H2Limits::FORWARD`], [`H2Limits::REGISTRY`], [`H2Limits::TUNNEL`]), written once and
//! chosen for the traffic that hop carries; a config section of [`H2Settings`] overrides
//! any of them and is validated once, naming the key. Nothing is left to a library
//! default, because those defaults are abuse guards tuned for the open internet and the
//! relay's own traffic trips them at volume:
//!
//! - h2 remembers a stream it reset for `reset_stream_duration` (1 s) and at most
//!   `reset_stream_memory` (50) of them. A frame the peer had already sent on a stream that
//!   was forgotten is answered with RST_STREAM(STREAM_CLOSED), and h2 counts those resets
//!   over the connection's *whole life*; at `max_local_error_resets` (1024) it sends GOAWAY
//!   ENHANCE_YOUR_CALM, failing every call on the connection. A dispatcher cancelling a few
//!   thousand calls (callers that went away) would get there in hours.
//! - A stream reset by the peer before this side accepted it counts against
//!   `max_pending_accept_resets` (20, the rapid-reset guard); an agent's growth step of
//!   hundreds of streams through a load balancer can reach that when opens time out.
//!
//! So the internal hops remember many resets for long (late frames of a cancelled call are
//! ignored, never answered), and their lifetime counter of error resets is off between
//! dispatchers and tunnel servers: the peers there are the relay's own processes,
//! authenticated by mutual TLS or a shared key, and a connection between them that dies
//! costs every call on it. The agent listener keeps both guards, set far above what agents
//! cause; the front keeps h2's own, since it faces callers.
//!
//! # Isolation: every stream's window fits in its connection's
//!
//! HTTP/2 flow control has two windows: one per stream and one per connection, shared by
//! the connection's streams. A receiver gives window back only as its reader consumes the
//! data, so a call whose reader stops (a caller who does not read its download, an upstream
//! that does not read its upload) keeps up to one stream window of its connection's window
//! for as long as it stalls. If the connection window is smaller than the stream windows of
//! the streams the connection may carry, a few stalled calls take all of it and every other
//! call on the connection stops (with 1 MiB stream windows and an 8 MiB connection window,
//! eight stalled downloads stopped a whole dispatcher). So every hop keeps
//!
//! ```text
//! connection_window_bytes >= max_concurrent_streams x stream_window_bytes
//! ```
//!
//! The connection window defaults to that product, a smaller one is a configuration error,
//! and the product must fit in HTTP/2's largest window (2^31 - 1). On the side that accepts
//! connections, `max_concurrent_streams` is what the peer may open (SETTINGS); on the side
//! that dials, it is also the most streams this side opens on one connection, opening
//! another connection when all are full (the dispatcher's connections to a tunnel server,
//! the agent's to a tunnel endpoint). A stalled call then holds its own stream window and
//! nothing another call needs, whatever the number of stalled calls.
//!
//! The connection window is credit, not memory: what a process buffers for stalled calls
//! is at most their stream windows (stalled calls x `stream_window_bytes` per hop), and the
//! defaults keep that per call at 1 MiB (forward hop) or 256 KiB (every other hop).
//!
//! This module must not open connections itself; `grpc` applies these limits to tonic
//! endpoints and servers, [`H2Limits::hyper_server`] to the front's hyper server.

use crate::config::ConfigError;
use serde::Deserialize;
use std::time::Duration;

/// The limits of one hop's HTTP/2 connections, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H2Limits {
    /// Streams the peer may have open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS
    /// this side announces as a server); on a dialing side, also the most streams it opens
    /// on one connection before it opens another.
    pub max_concurrent_streams: u32,
    /// Receive window of each stream: what one call may have in flight towards this side
    /// before the sender waits.
    pub stream_window_bytes: u32,
    /// Receive window of the whole connection, shared by its streams: at least
    /// `max_concurrent_streams x stream_window_bytes` (see the module docs).
    pub connection_window_bytes: u32,
    /// Largest header block accepted (SETTINGS_MAX_HEADER_LIST_SIZE).
    pub max_header_list_bytes: u32,
    /// Period of HTTP/2 PINGs on the connection, to find a dead peer.
    pub keepalive_interval: Duration,
    /// How long a PING may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Streams the peer may reset before this side accepted them, at once (rapid-reset
    /// guard); past it the connection gets GOAWAY.
    pub max_pending_accept_resets: usize,
    /// Resets this side may send over a connection's life because the peer sent a frame on
    /// a stream this side no longer knows; past it GOAWAY ENHANCE_YOUR_CALM. `None`: no
    /// bound (the internal hops; see the module docs).
    pub max_local_error_resets: Option<usize>,
    /// Streams this side reset and still remembers, so that frames the peer sent before it
    /// saw the reset are ignored instead of answered with a reset (client side only: the
    /// servers of this workspace cannot set it and keep h2's 50 per second).
    pub reset_stream_memory: usize,
    /// How long a reset stream is remembered.
    pub reset_stream_duration: Duration,
}

impl H2Limits {
    /// The dispatcher's HTTP front: callers on the open network. h2's guards stay on.
    pub const FRONT: H2Limits = H2Limits {
        max_concurrent_streams: 256,
        stream_window_bytes: 256 * 1024,
        connection_window_bytes: 256 * 256 * 1024,
        max_header_list_bytes: 64 * 1024,
        keepalive_interval: Duration::from_secs(20),
        keepalive_timeout: Duration::from_secs(10),
        max_pending_accept_resets: 20,
        max_local_error_resets: Some(1024),
        reset_stream_memory: 1024,
        reset_stream_duration: Duration::from_secs(10),
    };

    /// Dispatcher -> tunnel server (carriers and `Forward.Call`, one stream per call in
    /// flight): a dispatcher's calls to one server multiplex on its connections to it, 1024
    /// streams each (more calls open another connection), and a connection carries hundreds
    /// of thousands of cancellations over its life.
    pub const FORWARD: H2Limits = H2Limits {
        max_concurrent_streams: 1024,
        stream_window_bytes: 1024 * 1024,
        connection_window_bytes: 1024 * 1024 * 1024,
        max_header_list_bytes: 64 * 1024,
        keepalive_interval: Duration::from_millis(750),
        keepalive_timeout: Duration::from_secs(2),
        max_pending_accept_resets: 16_384,
        max_local_error_resets: None,
        reset_stream_memory: 16_384,
        reset_stream_duration: Duration::from_secs(30),
    };

    /// Tunnel server -> dispatcher registry (one long report stream per server).
    pub const REGISTRY: H2Limits = H2Limits {
        max_concurrent_streams: 64,
        stream_window_bytes: 256 * 1024,
        connection_window_bytes: 64 * 256 * 1024,
        max_header_list_bytes: 16 * 1024,
        keepalive_interval: Duration::from_millis(750),
        keepalive_timeout: Duration::from_secs(2),
        max_pending_accept_resets: 64,
        max_local_error_resets: None,
        reset_stream_memory: 64,
        reset_stream_duration: Duration::from_secs(30),
    };

    /// Agent -> tunnel server (`Tunnel.Connect`, long-lived streams; through a load
    /// balancer many agents may share one connection). Growth steps open hundreds of
    /// streams at once (at most `max_opening` per agent at a time), retirement closes
    /// them: the reset guards must allow for both. The agent listener may face the open
    /// network (a token is checked per stream, after the connection is up), so both of
    /// its reset guards stay on, far above what agents cause: a stream dies rarely, and
    /// only then can a late frame meet a forgotten stream. 4096 streams a connection: twice
    /// an agent's `max_streams`, so an agent dialing a server directly needs one connection.
    pub const TUNNEL: H2Limits = H2Limits {
        max_concurrent_streams: 4096,
        stream_window_bytes: 256 * 1024,
        connection_window_bytes: 4096 * 256 * 1024,
        max_header_list_bytes: 16 * 1024,
        keepalive_interval: Duration::from_millis(750),
        keepalive_timeout: Duration::from_secs(2),
        max_pending_accept_resets: 1024,
        max_local_error_resets: Some(65_536),
        reset_stream_memory: 4096,
        reset_stream_duration: Duration::from_secs(30),
    };

    /// Applies the server-side limits to the HTTP/2 half of hyper-util's auto (HTTP/1.1
    /// and HTTP/2) server builder.
    pub fn hyper_server<E>(&self, b: &mut hyper_util::server::conn::auto::Http2Builder<'_, E>) {
        b.max_concurrent_streams(self.max_concurrent_streams)
            .initial_stream_window_size(self.stream_window_bytes)
            .initial_connection_window_size(self.connection_window_bytes)
            .max_header_list_size(self.max_header_list_bytes)
            .keep_alive_interval(self.keepalive_interval)
            .keep_alive_timeout(self.keepalive_timeout)
            .max_pending_accept_reset_streams(self.max_pending_accept_resets)
            .max_local_error_reset_streams(self.max_local_error_resets);
    }
}

/// A config section overriding a hop's [`H2Limits`]; every key is optional.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct H2Settings {
    pub max_concurrent_streams: Option<u32>,
    pub stream_window_bytes: Option<u32>,
    pub connection_window_bytes: Option<u32>,
    pub max_header_list_bytes: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    pub keepalive_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub keepalive_timeout: Option<Duration>,
    pub max_pending_accept_resets: Option<usize>,
    /// 0 means no bound.
    pub max_local_error_resets: Option<usize>,
    pub reset_stream_memory: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    pub reset_stream_duration: Option<Duration>,
}

/// HTTP/2's smallest and largest flow-control windows.
const MIN_WINDOW: u32 = 65_535;
const MAX_WINDOW: u32 = (1 << 31) - 1;

impl H2Settings {
    /// The hop's defaults with these overrides, validated. `section` names the config
    /// section in errors (e.g. `forward_h2`).
    pub fn resolve(&self, defaults: H2Limits, section: &str) -> Result<H2Limits, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        let window = |v: Option<u32>, d: u32, k: &str| -> Result<u32, ConfigError> {
            let v = v.unwrap_or(d);
            if !(MIN_WINDOW..=MAX_WINDOW).contains(&v) {
                return Err(ConfigError::invalid(
                    key(k),
                    format!("must be between {MIN_WINDOW} and {MAX_WINDOW} bytes"),
                ));
            }
            Ok(v)
        };
        let positive = |v: Option<usize>, d: usize, k: &str| -> Result<usize, ConfigError> {
            let v = v.unwrap_or(d);
            if v == 0 {
                return Err(ConfigError::invalid(key(k), "must be at least 1"));
            }
            Ok(v)
        };
        let nonzero =
            |v: Option<Duration>, d: Duration, k: &str| -> Result<Duration, ConfigError> {
                let v = v.unwrap_or(d);
                if v.is_zero() {
                    return Err(ConfigError::invalid(key(k), "must be above 0s"));
                }
                Ok(v)
            };
        let limits = H2Limits {
            max_concurrent_streams: positive(
                self.max_concurrent_streams.map(|v| v as usize),
                defaults.max_concurrent_streams as usize,
                "max_concurrent_streams",
            )? as u32,
            stream_window_bytes: window(
                self.stream_window_bytes,
                defaults.stream_window_bytes,
                "stream_window_bytes",
            )?,
            // Set below, from the resolved streams and stream window.
            connection_window_bytes: 0,
            max_header_list_bytes: positive(
                self.max_header_list_bytes.map(|v| v as usize),
                defaults.max_header_list_bytes as usize,
                "max_header_list_bytes",
            )? as u32,
            keepalive_interval: nonzero(
                self.keepalive_interval,
                defaults.keepalive_interval,
                "keepalive_interval",
            )?,
            keepalive_timeout: nonzero(
                self.keepalive_timeout,
                defaults.keepalive_timeout,
                "keepalive_timeout",
            )?,
            max_pending_accept_resets: positive(
                self.max_pending_accept_resets,
                defaults.max_pending_accept_resets,
                "max_pending_accept_resets",
            )?,
            max_local_error_resets: match self.max_local_error_resets {
                None => defaults.max_local_error_resets,
                Some(0) => None,
                Some(n) => Some(n),
            },
            reset_stream_memory: positive(
                self.reset_stream_memory,
                defaults.reset_stream_memory,
                "reset_stream_memory",
            )?,
            reset_stream_duration: nonzero(
                self.reset_stream_duration,
                defaults.reset_stream_duration,
                "reset_stream_duration",
            )?,
        };
        let mut limits = limits;
        let (streams, stream_window) = (
            u64::from(limits.max_concurrent_streams),
            u64::from(limits.stream_window_bytes),
        );
        let needed = streams * stream_window;
        if needed > u64::from(MAX_WINDOW) {
            return Err(ConfigError::invalid(
                key("max_concurrent_streams"),
                format!(
                    "max_concurrent_streams x stream_window_bytes ({streams} x {stream_window} = {needed} bytes) is over HTTP/2's largest connection window ({MAX_WINDOW}): lower either, so that every stream's window fits in its connection's"
                ),
            ));
        }
        limits.connection_window_bytes = match self.connection_window_bytes {
            None => (needed as u32).max(MIN_WINDOW),
            Some(c) if u64::from(c) < needed => {
                return Err(ConfigError::invalid(
                    key("connection_window_bytes"),
                    format!(
                        "must be at least max_concurrent_streams x stream_window_bytes ({streams} x {stream_window} = {needed} bytes): with less, calls that stop reading take the whole connection window and every other call on the connection stops"
                    ),
                ));
            }
            Some(c) => window(Some(c), c, "connection_window_bytes")?,
        };
        Ok(limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_overrides_give_the_hop_defaults() {
        let s = H2Settings::default();
        assert_eq!(
            s.resolve(H2Limits::FORWARD, "h2").unwrap(),
            H2Limits::FORWARD
        );
        assert_eq!(s.resolve(H2Limits::FRONT, "h2").unwrap(), H2Limits::FRONT);
    }

    #[test]
    fn overrides_apply_and_zero_lifts_the_error_reset_bound() {
        let s: H2Settings = toml::from_str(
            "max_concurrent_streams = 10\nmax_local_error_resets = 0\nkeepalive_interval = \"5s\"",
        )
        .unwrap();
        let l = s.resolve(H2Limits::FRONT, "front_h2").unwrap();
        assert_eq!(l.max_concurrent_streams, 10);
        assert_eq!(l.max_local_error_resets, None);
        assert_eq!(l.keepalive_interval, Duration::from_secs(5));
        assert_eq!(l.stream_window_bytes, H2Limits::FRONT.stream_window_bytes);
    }

    #[test]
    fn every_hops_connection_window_covers_all_its_streams_windows() {
        for d in [
            H2Limits::FRONT,
            H2Limits::FORWARD,
            H2Limits::REGISTRY,
            H2Limits::TUNNEL,
        ] {
            assert!(
                u64::from(d.connection_window_bytes)
                    >= u64::from(d.max_concurrent_streams) * u64::from(d.stream_window_bytes),
                "{d:?}"
            );
        }
    }

    #[test]
    fn the_connection_window_follows_the_streams_and_their_windows() {
        let s: H2Settings =
            toml::from_str("max_concurrent_streams = 8\nstream_window_bytes = 65535").unwrap();
        let l = s.resolve(H2Limits::FORWARD, "forward_h2").unwrap();
        assert_eq!(l.connection_window_bytes, 8 * 65_535);
        // More than the product is allowed (credit, not memory).
        let s: H2Settings = toml::from_str(
            "max_concurrent_streams = 8\nstream_window_bytes = 65535\nconnection_window_bytes = 1048576",
        )
        .unwrap();
        let l = s.resolve(H2Limits::FORWARD, "forward_h2").unwrap();
        assert_eq!(l.connection_window_bytes, 1_048_576);
    }

    #[test]
    fn a_connection_window_smaller_than_its_streams_windows_is_refused() {
        let s: H2Settings = toml::from_str("connection_window_bytes = 8388608").unwrap();
        let e = s
            .resolve(H2Limits::FRONT, "front_h2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("front_h2.connection_window_bytes"), "{e}");
        assert!(e.contains("256 x 262144"), "{e}");
        let s: H2Settings = toml::from_str("max_concurrent_streams = 16384").unwrap();
        let e = s
            .resolve(H2Limits::FORWARD, "forward_h2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("forward_h2.max_concurrent_streams"), "{e}");
        assert!(e.contains("largest connection window"), "{e}");
    }

    #[test]
    fn bad_values_name_the_key() {
        let s: H2Settings = toml::from_str("stream_window_bytes = 10").unwrap();
        let e = s.resolve(H2Limits::FORWARD, "forward_h2").unwrap_err();
        assert!(
            e.to_string().contains("forward_h2.stream_window_bytes"),
            "{e}"
        );
        let s: H2Settings = toml::from_str("reset_stream_memory = 0").unwrap();
        let e = s.resolve(H2Limits::TUNNEL, "h2").unwrap_err();
        assert!(e.to_string().contains("h2.reset_stream_memory"), "{e}");
        let e = toml::from_str::<H2Settings>("max_streams = 1").unwrap_err();
        assert!(e.to_string().contains("max_streams"), "{e}");
    }
}
