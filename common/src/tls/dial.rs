//! A client's TLS dial: TCP, then the handshake within [`super::HANDSHAKE_TIMEOUT`] with
//! the config in force, and the connector tonic dials through.

use super::{ClientTls, Tls, HANDSHAKE_TIMEOUT};
use rustls::pki_types::ServerName;
use std::pin::Pin;
use tokio::net::TcpStream;

/// The host a connector dials for `uri`, an IPv6 literal without its brackets.
pub(crate) fn dial_host(uri: &http::Uri) -> std::io::Result<String> {
    let host = uri.host().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "url without a host")
    })?;
    Ok(host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string())
}

/// A dialed TLS connection, ready for hyper/tonic.
pub type TlsIo =
    hyper_util::rt::TokioIo<crate::h2io::H2Io<tokio_rustls::client::TlsStream<TcpStream>>>;
/// The future of one TLS dial.
pub type ConnectFuture = Pin<Box<dyn std::future::Future<Output = std::io::Result<TlsIo>> + Send>>;

impl Tls<ClientTls> {
    /// Opens TCP to `addr` and runs the handshake, verifying `host` (or the configured
    /// `server_name`).
    pub async fn connect(
        &self,
        host: &str,
        addr: &str,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        let name = self
            .settings
            .server_name
            .as_deref()
            .unwrap_or(host)
            .to_string();
        let name = ServerName::try_from(name)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let connector = tokio_rustls::TlsConnector::from(self.current.load_full());
        tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, tcp))
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "tls handshake timed out")
            })?
    }

    /// A connector for `tonic::transport::Endpoint::connect_with_connector`: dials the
    /// URI's host and port over TLS.
    pub fn tonic_connector(
        &self,
    ) -> impl tower::Service<
        http::Uri,
        Response = TlsIo,
        Error = std::io::Error,
        Future = ConnectFuture,
    > + Clone
           + Send
           + 'static {
        self.tonic_connector_to(None)
    }

    /// [`TlsClient::tonic_connector`] that also records each connection's remote address
    /// in `peer`.
    pub fn tonic_connector_to(
        &self,
        peer: Option<crate::peer::PeerAddr>,
    ) -> impl tower::Service<
        http::Uri,
        Response = TlsIo,
        Error = std::io::Error,
        Future = ConnectFuture,
    > + Clone
           + Send
           + 'static {
        let me = self.clone();
        tower::service_fn(move |uri: http::Uri| {
            let me = me.clone();
            let peer = peer.clone();
            Box::pin(async move {
                let host = dial_host(&uri)?;
                let port = uri.port_u16().unwrap_or(443);
                let addr = if host.contains(':') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                };
                let tls = me.connect(&host, &addr).await?;
                if let Some(peer) = &peer {
                    peer.set(tls.get_ref().0.peer_addr().ok());
                }
                Ok(hyper_util::rt::TokioIo::new(crate::h2io::H2Io::new(tls)))
            }) as ConnectFuture
        })
    }
}
