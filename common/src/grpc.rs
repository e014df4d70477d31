//! Every gRPC client endpoint and server of the relay is built here, so a hop's TCP and
//! HTTP/2 settings (TCP_NODELAY, keep-alive, windows and limits from [`H2Limits`]) are
//! applied in one place:
//!
//! - [`server`]: a tonic `Server` builder (the tunnel server's agent and forward
//!   listeners, the dispatcher's registry listener);
//! - [`GrpcClient`]: the dial side (agent -> tunnel server, dispatcher -> tunnel server,
//!   tunnel server -> dispatcher registry): endpoints from URLs, and channels over TLS
//!   (`https://`, with the hop's [`TlsClient`]) or plain h2c.
//!
//! Small frames (heads, pings, reports) go out at once: TCP_NODELAY is on everywhere.
//! Every connection a client dials runs on [`H2Io`] (the tunnel server's listeners wrap
//! theirs alike), so a batch of calls' frames goes out in one write whatever their sizes
//! (`h2io`).
//! This module must not choose a hop's limits (`h2` does) nor open connections on its own:
//! a lazy channel dials on first use, [`GrpcClient::connect`] when awaited.

use crate::h2::H2Limits;
use crate::h2io::H2Io;
pub use crate::peer::PeerAddr;
use crate::tls::TlsClient;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint, Server};

/// A tonic server builder with the hop's server-side limits and TCP_NODELAY.
pub fn server(h2: &H2Limits) -> Server {
    Server::builder()
        .tcp_nodelay(true)
        .max_concurrent_streams(Some(h2.max_concurrent_streams))
        .initial_stream_window_size(Some(h2.stream_window_bytes))
        .initial_connection_window_size(Some(h2.connection_window_bytes))
        .http2_max_header_list_size(Some(h2.max_header_list_bytes))
        .http2_keepalive_interval(Some(h2.keepalive_interval))
        .http2_keepalive_timeout(Some(h2.keepalive_timeout))
        .http2_max_pending_accept_reset_streams(Some(h2.max_pending_accept_resets))
        .http2_max_local_error_reset_streams(h2.max_local_error_resets)
}

/// How one hop dials its gRPC peers: its HTTP/2 limits, connect timeout and TLS.
#[derive(Clone)]
pub struct GrpcClient {
    h2: H2Limits,
    connect_timeout: Duration,
    keepalive_while_idle: bool,
    tls: Option<TlsClient>,
}

impl std::fmt::Debug for GrpcClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcClient")
            .field("h2", &self.h2)
            .field("connect_timeout", &self.connect_timeout)
            .field("keepalive_while_idle", &self.keepalive_while_idle)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl GrpcClient {
    /// `tls`: the client config for `https://` peers; `None` dials plain h2c.
    pub fn new(h2: H2Limits, connect_timeout: Duration, tls: Option<TlsClient>) -> Self {
        GrpcClient {
            h2,
            connect_timeout,
            keepalive_while_idle: false,
            tls,
        }
    }

    /// PINGs also while the connection carries no stream (the agent's connections, which
    /// must find a dead tunnel server before the next open needs them). Off by default:
    /// then only connections with calls in flight are pinged.
    pub fn keepalive_while_idle(mut self) -> Self {
        self.keepalive_while_idle = true;
        self
    }

    /// Whether peers are dialed over TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// An endpoint for `url` with this hop's settings; fails on a URL tonic cannot use.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, tonic::transport::Error> {
        let h2 = &self.h2;
        Ok(Endpoint::from_shared(url.to_string())?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .keep_alive_while_idle(self.keepalive_while_idle)
            .initial_stream_window_size(Some(h2.stream_window_bytes))
            .initial_connection_window_size(Some(h2.connection_window_bytes))
            .http2_max_header_list_size(h2.max_header_list_bytes)
            .http2_keep_alive_interval(h2.keepalive_interval)
            .keep_alive_timeout(h2.keepalive_timeout)
            .http2_max_concurrent_reset_streams(h2.reset_stream_memory)
            .http2_reset_stream_duration(h2.reset_stream_duration)
            .http2_max_local_error_reset_streams(h2.max_local_error_resets))
    }

    /// A channel that dials `endpoint` on first use (and again after the connection dies).
    pub fn lazy(&self, endpoint: Endpoint) -> Channel {
        match &self.tls {
            Some(tls) => endpoint.connect_with_connector_lazy(tls.tonic_connector()),
            None => endpoint.connect_with_connector_lazy(plain_connector(None)),
        }
    }

    /// [`GrpcClient::lazy`], recording the remote address of each connection it dials in
    /// `peer` (a channel holds one connection at a time, so `peer` names the current one).
    pub fn lazy_observed(&self, endpoint: Endpoint, peer: PeerAddr) -> Channel {
        match &self.tls {
            Some(tls) => endpoint.connect_with_connector_lazy(tls.tonic_connector_to(Some(peer))),
            None => endpoint.connect_with_connector_lazy(plain_connector(Some(peer))),
        }
    }

    /// A channel connected to `endpoint` now.
    pub async fn connect(&self, endpoint: Endpoint) -> Result<Channel, tonic::transport::Error> {
        match &self.tls {
            Some(tls) => endpoint.connect_with_connector(tls.tonic_connector()).await,
            None => endpoint.connect_with_connector(plain_connector(None)).await,
        }
    }
}

type PlainIo = hyper_util::rt::TokioIo<H2Io<tokio::net::TcpStream>>;

/// Dials the URI's host and port over plain TCP, Nagle off, under [`H2Io`] (see
/// `h2io`); tonic bounds the dial by the endpoint's `connect_timeout`. Records the
/// connection's remote address in `peer`, when given.
fn plain_connector(
    peer: Option<PeerAddr>,
) -> impl tower::Service<
    http::Uri,
    Response = PlainIo,
    Error = std::io::Error,
    Future = Pin<Box<dyn Future<Output = std::io::Result<PlainIo>> + Send>>,
> + Clone
       + Send
       + 'static {
    tower::service_fn(move |uri: http::Uri| {
        let peer = peer.clone();
        Box::pin(async move {
            let host = crate::tls::dial_host(&uri)?;
            let port = uri.port_u16().unwrap_or(80);
            let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            if let Some(peer) = &peer {
                peer.set(tcp.peer_addr().ok());
            }
            Ok(hyper_util::rt::TokioIo::new(H2Io::new(tcp)))
        }) as Pin<Box<dyn Future<Output = std::io::Result<PlainIo>> + Send>>
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_carry_the_dial_settings_and_bad_urls_are_errors() {
        let client = GrpcClient::new(H2Limits::FORWARD, Duration::from_secs(5), None);
        let e = client.endpoint("http://127.0.0.1:7000").unwrap();
        assert_eq!(e.uri().to_string(), "http://127.0.0.1:7000/");
        assert!(client.endpoint("not a url\n").is_err());
        assert!(!client.is_tls());
    }
}
