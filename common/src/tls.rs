//! TLS for every hop, with rustls: server and client configs built from PEM files,
//! mutual TLS where a client CA is configured, and reloading on SIGHUP or when a file
//! changes, without dropping established connections (each new handshake uses the newest
//! config; live connections keep theirs).
//!
//! This module owns certificates and handshakes only; it knows nothing of tunnels or
//! calls. A config that fails to load on reload is logged and the previous one stays.
//!
//! Each loaded certificate file's expiry is exported as
//! `relay_tls_certificate_expiry_timestamp_seconds{section,role,file}` ([`CertExpiry`]),
//! updated on every successful reload, so an alert can warn before a hop breaks.

use crate::config::ConfigError;
use arc_swap::ArcSwap;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Whether this process has already said that some hop runs plain text.
static PLAIN_TEXT_NOTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Says that `hops` of `component` run plain text (`insecure = true`): one warning line per
/// process. A binary runs one component, so this is its one line naming every plain hop.
/// Where several components share a process (`relay-fleet demo`, `relay-fleet run`, which
/// call it first with a summary of their own), only the first call warns; later ones log at
/// debug level, so a thousand simulated agents do not print a thousand lines.
pub fn note_plain_text(component: &str, hops: &[&str]) {
    if hops.is_empty() {
        return;
    }
    let hops = hops.join(", ");
    if PLAIN_TEXT_NOTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        debug!(component, hops = %hops, "insecure = true: plain text without TLS");
    } else {
        warn!(component, hops = %hops, "insecure = true: plain text without TLS");
    }
}

/// ALPN for gRPC hops: HTTP/2 only.
pub const ALPN_H2: &[&[u8]] = &[b"h2"];
/// ALPN for the dispatcher's HTTP front: HTTP/2 and HTTP/1.1.
pub const ALPN_HTTP: &[&[u8]] = &[b"h2", b"http/1.1"];

/// Longest a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// `[tls]` of a listener.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerTls {
    /// PEM certificate chain presented to clients.
    pub cert: PathBuf,
    /// PEM private key of `cert`.
    pub key: PathBuf,
    /// PEM bundle of CAs whose client certificates are accepted. Set: mutual TLS.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: accept clients without a certificate too (they are then
    /// authenticated by other means, e.g. a token).
    #[serde(default)]
    pub client_cert_optional: bool,
    /// With `client_ca`: the names (DNS or URI subject alternative names) a client
    /// certificate must carry one of. Empty: any certificate the CA signed. Pin it when
    /// the CA signs other parties' certificates too (agents', other services').
    #[serde(default)]
    pub client_names: Vec<String>,
}

/// `[tls]` of a client (dialer).
#[derive(Clone, Debug, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ClientTls {
    /// PEM bundle of CAs trusted to sign the server's certificate.
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain, for servers that require mutual TLS.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert`.
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// Name to verify in the server's certificate instead of the URL's host.
    #[serde(default)]
    pub server_name: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("{path}: no certificate found")]
    NoCertificate { path: PathBuf },
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    #[error("client CA: {0}")]
    Verifier(String),
    #[error("tls key `{key}`: {message}")]
    Config { key: &'static str, message: String },
    /// A non-TLS item reloaded through [`watch`] (a token store, say) failed.
    #[error("{0}")]
    Other(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::Read {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Read {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for c in certs(path)? {
        store.add(c)?;
    }
    Ok(store)
}

/// Builds a server config from PEM files.
pub fn server_config(s: &ServerTls, alpn: &[&[u8]]) -> Result<ServerConfig, TlsError> {
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match &s.client_ca {
        Some(ca) => {
            let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(ca)?),
                provider(),
            );
            let v = if s.client_cert_optional {
                v.allow_unauthenticated()
            } else {
                v
            };
            let v = v.build().map_err(|e| TlsError::Verifier(e.to_string()))?;
            if s.client_names.is_empty() {
                builder.with_client_cert_verifier(v)
            } else {
                builder.with_client_cert_verifier(Arc::new(PinnedNames {
                    inner: v,
                    names: s.client_names.clone(),
                }))
            }
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs(&s.cert)?, key(&s.key)?)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// The DNS and URI subject alternative names of a DER certificate (none if unreadable).
pub fn cert_names(der: &[u8]) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            GeneralName::URI(u) => Some(u.to_string()),
            _ => None,
        })
        .collect()
}

/// A client verifier that, past the CA check, requires the certificate to name one of
/// `names` (`client_names`).
#[derive(Debug)]
struct PinnedNames {
    inner: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    names: Vec<String>,
}

impl rustls::server::danger::ClientCertVerifier for PinnedNames {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let ok = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if cert_names(end_entity.as_ref())
            .iter()
            .any(|n| self.names.iter().any(|a| a == n))
        {
            Ok(ok)
        } else {
            Err(rustls::Error::General(
                "the client certificate names none of client_names".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Builds a client config from PEM files.
pub fn client_config(c: &ClientTls, alpn: &[&[u8]]) -> Result<ClientConfig, TlsError> {
    let Some(ca) = &c.ca else {
        return Err(TlsError::Config {
            key: "ca",
            message: "a CA bundle is required to verify the server".into(),
        });
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(ca)?);
    let mut config = match (&c.cert, &c.key) {
        (Some(cert), Some(k)) => builder.with_client_auth_cert(certs(cert)?, key(k)?)?,
        (None, None) => builder.with_no_client_auth(),
        _ => {
            return Err(TlsError::Config {
                key: "cert",
                message: "cert and key must be given together".into(),
            })
        }
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// `relay_tls_certificate_expiry_timestamp_seconds{section,role,file}`: when each loaded
/// certificate file stops being valid, in seconds since the Unix epoch. `section` is the
/// config section (`agent_tls`, `forward_tls`, ...), `role` what the file is in it (`cert`,
/// `ca`, `client_ca`) and `file` its path. A file holding several certificates (a chain,
/// a CA bundle) reports the earliest `notAfter` among them: the hop breaks when the first
/// one expires. Updated at start and after every successful reload.
#[derive(Clone)]
pub struct CertExpiry {
    gauge: prometheus::GaugeVec,
}

impl CertExpiry {
    /// The metric's name.
    pub const NAME: &'static str = "relay_tls_certificate_expiry_timestamp_seconds";

    /// Creates the metric and registers it on `registry`.
    pub fn register(registry: &prometheus::Registry) -> prometheus::Result<Self> {
        let gauge = prometheus::GaugeVec::new(
            prometheus::Opts::new(
                Self::NAME,
                "When a loaded certificate file expires (earliest notAfter of its certificates), seconds since the Unix epoch",
            ),
            &["section", "role", "file"],
        )?;
        registry.register(Box::new(gauge.clone()))?;
        Ok(CertExpiry { gauge })
    }

    fn record(&self, section: &str, files: &[(&'static str, &Path)]) {
        for (role, path) in files {
            match earliest_expiry(path) {
                Ok(t) => self
                    .gauge
                    .with_label_values(&[section, role, &path.display().to_string()])
                    .set(t as f64),
                Err(e) => {
                    warn!(section, role, error = %e, "cannot read the certificate's expiry")
                }
            }
        }
    }
}

/// The earliest `notAfter` (seconds since the Unix epoch) among the PEM certificates in
/// `path`.
pub fn earliest_expiry(path: &Path) -> Result<i64, TlsError> {
    let mut earliest: Option<i64> = None;
    for der in certs(path)? {
        let (_, cert) =
            x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| TlsError::Read {
                path: path.to_path_buf(),
                message: format!("not an X.509 certificate: {e}"),
            })?;
        let t = cert.validity().not_after.timestamp();
        earliest = Some(earliest.map_or(t, |e| e.min(t)));
    }
    earliest.ok_or_else(|| TlsError::NoCertificate {
        path: path.to_path_buf(),
    })
}

/// Something that can rebuild itself from its files.
pub trait Reload: Send + Sync {
    /// Rebuilds from the files; on error the old config stays.
    fn reload(&self) -> Result<(), TlsError>;
    /// The files it is built from (watched for changes).
    fn files(&self) -> Vec<PathBuf>;
    /// For log lines.
    fn name(&self) -> &str;
}

/// A server config that can be swapped while serving.
#[derive(Clone)]
pub struct TlsServer {
    settings: ServerTls,
    alpn: &'static [&'static [u8]],
    current: Arc<ArcSwap<ServerConfig>>,
    name: &'static str,
    expiry: Option<CertExpiry>,
}

impl TlsServer {
    pub fn new(
        name: &'static str,
        settings: ServerTls,
        alpn: &'static [&'static [u8]],
    ) -> Result<Self, TlsError> {
        let config = server_config(&settings, alpn)?;
        Ok(TlsServer {
            settings,
            alpn,
            current: Arc::new(ArcSwap::from_pointee(config)),
            name,
            expiry: None,
        })
    }

    /// Exports the expiry of its certificate files now and after every reload. Call it
    /// before cloning the server into [`watch`].
    pub fn with_expiry(mut self, expiry: &CertExpiry) -> Self {
        expiry.record(self.name, &self.cert_files());
        self.expiry = Some(expiry.clone());
        self
    }

    fn cert_files(&self) -> Vec<(&'static str, &Path)> {
        let mut f = vec![("cert", self.settings.cert.as_path())];
        f.extend(self.settings.client_ca.as_deref().map(|p| ("client_ca", p)));
        f
    }

    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current.load_full())
    }

    /// The server config in force (it changes on reload).
    pub fn config(&self) -> Arc<ServerConfig> {
        self.current.load_full()
    }
}

impl Reload for TlsServer {
    fn reload(&self) -> Result<(), TlsError> {
        self.current
            .store(Arc::new(server_config(&self.settings, self.alpn)?));
        if let Some(e) = &self.expiry {
            e.record(self.name, &self.cert_files());
        }
        Ok(())
    }

    fn files(&self) -> Vec<PathBuf> {
        let mut f = vec![self.settings.cert.clone(), self.settings.key.clone()];
        f.extend(self.settings.client_ca.clone());
        f
    }

    fn name(&self) -> &str {
        self.name
    }
}

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

/// A client config that can be swapped while dialing.
#[derive(Clone)]
pub struct TlsClient {
    settings: ClientTls,
    alpn: &'static [&'static [u8]],
    current: Arc<ArcSwap<ClientConfig>>,
    name: &'static str,
    expiry: Option<CertExpiry>,
}

impl TlsClient {
    pub fn new(
        name: &'static str,
        settings: ClientTls,
        alpn: &'static [&'static [u8]],
    ) -> Result<Self, TlsError> {
        let config = client_config(&settings, alpn)?;
        Ok(TlsClient {
            settings,
            alpn,
            current: Arc::new(ArcSwap::from_pointee(config)),
            name,
            expiry: None,
        })
    }

    /// Exports the expiry of its certificate files now and after every reload. Call it
    /// before cloning the client into [`watch`].
    pub fn with_expiry(mut self, expiry: &CertExpiry) -> Self {
        expiry.record(self.name, &self.cert_files());
        self.expiry = Some(expiry.clone());
        self
    }

    fn cert_files(&self) -> Vec<(&'static str, &Path)> {
        let mut f: Vec<(&'static str, &Path)> = self
            .settings
            .ca
            .as_deref()
            .map(|p| ("ca", p))
            .into_iter()
            .collect();
        f.extend(self.settings.cert.as_deref().map(|p| ("cert", p)));
        f
    }

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

impl Reload for TlsClient {
    fn reload(&self) -> Result<(), TlsError> {
        self.current
            .store(Arc::new(client_config(&self.settings, self.alpn)?));
        if let Some(e) = &self.expiry {
            e.record(self.name, &self.cert_files());
        }
        Ok(())
    }

    fn files(&self) -> Vec<PathBuf> {
        let mut f: Vec<PathBuf> = self.settings.ca.iter().cloned().collect();
        f.extend(self.settings.cert.clone());
        f.extend(self.settings.key.clone());
        f
    }

    fn name(&self) -> &str {
        self.name
    }
}

/// A listener's TLS section as operators write it (`[agent_tls]`, `[tls]`...): TLS
/// settings, or `insecure = true` for plain h2c. Neither is a config error, so plain text is
/// always a written choice.
#[derive(Clone, Debug, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerTls {
    /// Serve plain text (h2c / HTTP/1.1) on this listener; the process warns at start.
    pub insecure: bool,
    /// PEM certificate chain presented to clients.
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert`.
    pub key: Option<PathBuf>,
    /// PEM bundle of CAs whose client certificates are accepted. Set: mutual TLS.
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: accept clients without a certificate too.
    pub client_cert_optional: bool,
    /// With `client_ca`: a client certificate must name one of these (DNS or URI subject
    /// alternative names, exact). Empty: any certificate the CA signed.
    pub client_names: Vec<String>,
}

/// Whether a listener insists on client certificates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientCerts {
    /// `client_ca` and `client_cert_optional` are the operator's choice.
    Optional,
    /// Mutual TLS: `client_ca` is required and every client must present a certificate.
    Required,
}

impl ListenerTls {
    /// Plain text, for tests and local examples.
    pub fn insecure() -> Self {
        ListenerTls {
            insecure: true,
            ..Default::default()
        }
    }

    /// TLS with these settings.
    pub fn tls(s: ServerTls) -> Self {
        ListenerTls {
            insecure: false,
            cert: Some(s.cert),
            key: Some(s.key),
            client_ca: s.client_ca,
            client_cert_optional: s.client_cert_optional,
            client_names: s.client_names,
        }
    }

    /// Checks the section (named `section` in errors): `Some` settings for TLS, `None` for
    /// plain text. Reads no file.
    pub fn resolve(
        &self,
        section: &str,
        certs: ClientCerts,
    ) -> Result<Option<ServerTls>, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        if self.insecure {
            if self.cert.is_some() || self.key.is_some() || self.client_ca.is_some() {
                return Err(ConfigError::invalid(
                    key("insecure"),
                    "insecure = true cannot be combined with cert, key or client_ca",
                ));
            }
            return Ok(None);
        }
        let (cert, k) = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => (c.clone(), k.clone()),
            (None, None) => {
                return Err(ConfigError::invalid(
                    section,
                    "TLS is required: set cert and key, or insecure = true to serve plain text",
                ))
            }
            (Some(_), None) => {
                return Err(ConfigError::invalid(key("key"), "is required with cert"))
            }
            (None, Some(_)) => {
                return Err(ConfigError::invalid(key("cert"), "is required with key"))
            }
        };
        if certs == ClientCerts::Required {
            if self.client_ca.is_none() {
                return Err(ConfigError::invalid(
                    key("client_ca"),
                    "is required: this hop uses mutual TLS",
                ));
            }
            if self.client_cert_optional {
                return Err(ConfigError::invalid(
                    key("client_cert_optional"),
                    "is not allowed: this hop uses mutual TLS",
                ));
            }
        }
        if self.client_cert_optional && self.client_ca.is_none() {
            return Err(ConfigError::invalid(
                key("client_cert_optional"),
                "needs client_ca",
            ));
        }
        if !self.client_names.is_empty() && self.client_ca.is_none() {
            return Err(ConfigError::invalid(key("client_names"), "needs client_ca"));
        }
        if self.client_names.iter().any(|n| n.trim().is_empty()) {
            return Err(ConfigError::invalid(
                key("client_names"),
                "must not contain an empty name",
            ));
        }
        Ok(Some(ServerTls {
            cert,
            key: k,
            client_ca: self.client_ca.clone(),
            client_cert_optional: self.client_cert_optional,
            client_names: self.client_names.clone(),
        }))
    }
}

impl ListenerTls {
    /// Checks that a mutual-TLS listener whose client certificate is the peer's whole
    /// authentication pins an identity: `client_names` lists the names a client
    /// certificate must carry. Without it any certificate the CA signed (an agent's, another
    /// service's) would be let in. `alternative` names another setting that pins the
    /// identity instead (the dispatcher's `registry.server_id_in_cert`); when it is set the
    /// check passes. Plain text (`insecure = true`) has nothing to pin.
    pub fn require_pinned(
        &self,
        section: &str,
        alternative: Option<(&str, bool)>,
    ) -> Result<(), ConfigError> {
        if self.insecure || !self.client_names.is_empty() {
            return Ok(());
        }
        match alternative {
            Some((_, true)) => Ok(()),
            Some((key, false)) => Err(ConfigError::invalid(
                format!("{section}.client_names"),
                format!(
                    "must name the client certificates allowed here (DNS or URI names), or set {key} = true: with neither, any certificate of client_ca is accepted"
                ),
            )),
            None => Err(ConfigError::invalid(
                format!("{section}.client_names"),
                "must name the client certificates allowed here (DNS or URI names): without it, any certificate of client_ca is accepted",
            )),
        }
    }
}

/// A dialer's TLS section (`[tls]` of the agent, `[forward_tls]` of the dispatcher...):
/// TLS settings for `https://` URLs, or `insecure = true` for plain `http://` URLs.
#[derive(Clone, Debug, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DialerTls {
    /// Dial plain `http://` URLs (h2c); the process warns at start.
    pub insecure: bool,
    /// PEM bundle of CAs trusted to sign the server's certificate.
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain, for servers that require mutual TLS.
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert`.
    pub key: Option<PathBuf>,
    /// Name to verify in the server's certificate instead of the URL's host.
    pub server_name: Option<String>,
}

impl DialerTls {
    /// Plain text, for tests and local examples.
    pub fn insecure() -> Self {
        DialerTls {
            insecure: true,
            ..Default::default()
        }
    }

    /// TLS with these settings.
    pub fn tls(c: ClientTls) -> Self {
        DialerTls {
            insecure: false,
            ca: c.ca,
            cert: c.cert,
            key: c.key,
            server_name: c.server_name,
        }
    }

    /// Checks the section: `Some` settings for TLS, `None` for plain text. `certs =
    /// Required` insists on a client certificate (the peer uses mutual TLS). Reads no file.
    pub fn resolve(
        &self,
        section: &str,
        certs: ClientCerts,
    ) -> Result<Option<ClientTls>, ConfigError> {
        let key = |k: &str| format!("{section}.{k}");
        if self.insecure {
            if self.ca.is_some() || self.cert.is_some() || self.key.is_some() {
                return Err(ConfigError::invalid(
                    key("insecure"),
                    "insecure = true cannot be combined with ca, cert or key",
                ));
            }
            return Ok(None);
        }
        if self.ca.is_none() {
            return Err(ConfigError::invalid(
                key("ca"),
                "TLS is required: set ca (the CA bundle that signs the server's certificate), or insecure = true to dial plain http://",
            ));
        }
        match (&self.cert, &self.key) {
            (Some(_), None) => {
                return Err(ConfigError::invalid(key("key"), "is required with cert"))
            }
            (None, Some(_)) => {
                return Err(ConfigError::invalid(key("cert"), "is required with key"))
            }
            (None, None) if certs == ClientCerts::Required => {
                return Err(ConfigError::invalid(
                    key("cert"),
                    "cert and key are required: this hop uses mutual TLS",
                ))
            }
            _ => {}
        }
        if let Some(name) = &self.server_name {
            if ServerName::try_from(name.clone()).is_err() {
                return Err(ConfigError::invalid(
                    key("server_name"),
                    "is not a DNS name or IP address",
                ));
            }
        }
        Ok(Some(ClientTls {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
            server_name: self.server_name.clone(),
        }))
    }

    /// Checks that `url` (config key `url_key`) has the scheme this section dials:
    /// `https://` with TLS, `http://` with `insecure = true`.
    pub fn check_url(&self, section: &str, url_key: &str, url: &str) -> Result<(), ConfigError> {
        let https = url.starts_with("https://");
        let http = url.starts_with("http://");
        match (self.insecure, http, https) {
            (true, true, _) | (false, _, true) => Ok(()),
            (true, _, true) => Err(ConfigError::invalid(
                url_key,
                format!("{url:?} is https:// but [{section}] says insecure = true; configure [{section}] ca (and cert/key) instead"),
            )),
            (false, true, _) => Err(ConfigError::invalid(
                url_key,
                format!("{url:?} is plain http://: use https:// with [{section}], or set [{section}] insecure = true"),
            )),
            _ => Err(ConfigError::invalid(url_key, format!("{url:?} is not an http:// or https:// URL"))),
        }
    }
}

/// What one process reloads from files (its certificates; the tunnel server's token store
/// too), and the one task that reloads them: every binary wires reload through this.
///
/// ```ignore
/// Reloads::default()
///     .with(front_tls.clone())
///     .with(forward_tls.clone())
///     .spawn(config.reload_interval, stop.clone());
/// ```
#[derive(Default)]
pub struct Reloads(Vec<Arc<dyn Reload>>);

impl Reloads {
    /// Adds an item if there is one (a hop without TLS has nothing to reload).
    pub fn with(mut self, item: Option<impl Reload + 'static>) -> Self {
        if let Some(item) = item {
            self.0.push(Arc::new(item));
        }
        self
    }

    pub fn push(&mut self, item: impl Reload + 'static) {
        self.0.push(Arc::new(item));
    }

    /// Spawns [`watch`] over the items: each is reloaded on SIGHUP and when one of its
    /// files changes (checked every `poll`), until `stop`. New connections use what was
    /// reloaded; established ones keep theirs. The SIGHUP handler is installed before
    /// this returns.
    pub fn spawn(self, poll: Duration, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        tokio::spawn(watch(self.0, poll, stop))
    }
}

/// Reloads every item on SIGHUP, and when one of its files changes (checked every
/// `poll`), until `stop`.
///
/// The SIGHUP handler is installed when this is called, not when the future first runs,
/// and also when there is nothing to reload: a process that serves (say, its `/healthz`)
/// after calling this never dies of a SIGHUP, whose default action ends the process. With
/// nothing to reload a SIGHUP is logged and ignored.
pub fn watch(
    items: Vec<Arc<dyn Reload>>,
    poll: Duration,
    stop: CancellationToken,
) -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    let hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(h) => Some(h),
        Err(e) => {
            warn!(error = %e, "cannot listen for SIGHUP; files are still checked every reload_interval");
            None
        }
    };
    #[cfg(not(unix))]
    let hup: Option<()> = None;
    watch_files(items, poll, stop, hup)
}

#[cfg(unix)]
type Hangup = tokio::signal::unix::Signal;
#[cfg(not(unix))]
type Hangup = ();

async fn watch_files(
    items: Vec<Arc<dyn Reload>>,
    poll: Duration,
    stop: CancellationToken,
    #[cfg_attr(not(unix), allow(unused_mut, unused_variables))] mut hup: Option<Hangup>,
) {
    let stamp = |r: &Arc<dyn Reload>| -> Vec<Option<SystemTime>> {
        r.files()
            .iter()
            .map(|f| std::fs::metadata(f).and_then(|m| m.modified()).ok())
            .collect()
    };
    let mut stamps: Vec<_> = items.iter().map(stamp).collect();
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        #[cfg(unix)]
        let hup_fut = async {
            match hup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hup_fut = std::future::pending::<()>();
        // With nothing to reload there are no files to check.
        let tick_fut = async {
            if items.is_empty() {
                std::future::pending::<()>().await;
            }
            tick.tick().await;
        };
        let forced = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = hup_fut => true,
            _ = tick_fut => false,
        };
        if items.is_empty() {
            info!("SIGHUP: nothing to reload (no certificate or token store file configured)");
            continue;
        }
        let trigger = if forced { "SIGHUP" } else { "file change" };
        for (i, item) in items.iter().enumerate() {
            let now = stamp(item);
            if !forced && now == stamps[i] {
                continue;
            }
            stamps[i] = now;
            match item.reload() {
                Ok(()) => info!(what = item.name(), trigger, "reloaded from its files"),
                Err(e) => {
                    warn!(what = item.name(), trigger, error = %e, "reload failed; keeping the previous one")
                }
            }
        }
    }
}

/// A server-side connection: plain TCP (where a config says `insecure = true`) or TLS.
pub enum MaybeTls {
    Plain(TcpStream),
    /// Over the listener's socket (see `socket`).
    Tls(Box<tokio_rustls::server::TlsStream<crate::socket::Socket>>),
}

impl MaybeTls {
    /// The local address of the connection.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.tcp().local_addr().ok()
    }

    fn tcp(&self) -> &TcpStream {
        match self {
            MaybeTls::Plain(s) => s,
            MaybeTls::Tls(s) => s.get_ref().0.tcp(),
        }
    }

    /// The names (DNS and URI SANs) of the client certificate that verified, if any.
    pub fn client_cert_names(&self) -> Vec<String> {
        match self {
            MaybeTls::Plain(_) => Vec::new(),
            MaybeTls::Tls(s) => s
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| cert_names(c.as_ref()))
                .unwrap_or_default(),
        }
    }

    /// Whether the peer presented a client certificate that verified.
    pub fn has_client_cert(&self) -> bool {
        match self {
            MaybeTls::Plain(_) => false,
            MaybeTls::Tls(s) => s
                .get_ref()
                .1
                .peer_certificates()
                .is_some_and(|c| !c.is_empty()),
        }
    }
}

impl AsyncRead for MaybeTls {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_read(cx, buf),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for MaybeTls {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write(cx, buf),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            MaybeTls::Plain(s) => s.is_write_vectored(),
            MaybeTls::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_flush(cx),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_shutdown(cx),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl tonic::transport::server::Connected for MaybeTls {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        tonic::transport::server::TcpConnectInfo {
            local_addr: self.tcp().local_addr().ok(),
            remote_addr: self.tcp().peer_addr().ok(),
        }
    }
}

#[cfg(test)]
mod tests;
