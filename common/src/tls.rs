//! TLS for every hop, with rustls: one reloadable config type for both ends of a hop
//! ([`Tls`]: [`TlsServer`] accepts, [`TlsClient`] dials), built from PEM files, mutual TLS
//! where a client CA is configured, and reloading on SIGHUP or when a file changes, without
//! dropping established connections (each new handshake uses the newest config; live
//! connections keep theirs).
//!
//! Along its seams:
//! - [`config`]: the TLS sections as operators write them ([`ListenerTls`], [`DialerTls`])
//!   and the settings they resolve to ([`ServerTls`], [`ClientTls`]); reads no file.
//! - [`verify`]: rustls configs built from the PEM files, the client-name pinning of mutual
//!   TLS, a certificate's names and expiry.
//! - [`reload`]: what reloads ([`Reload`], [`Reloads`]), the one task that reloads it
//!   ([`watch`]), and the certificates' expiry metric ([`CertExpiry`]).
//! - `dial` and `conn`: a client's TLS dial (and its tonic connector), and a server-side
//!   connection that is plain TCP or TLS ([`MaybeTls`]).
//!
//! This module owns certificates and handshakes only; it knows nothing of tunnels or
//! calls. A config that fails to load on reload is logged and the previous one stays.
//!
//! Each loaded certificate file's expiry is exported as
//! `relay_tls_certificate_expiry_timestamp_seconds{section,role,file}` ([`CertExpiry`]),
//! updated on every successful reload, so an alert can warn before a hop breaks.

pub mod config;
mod conn;
mod dial;
pub mod reload;
pub mod verify;

pub use config::{ClientCerts, ClientTls, DialerTls, ListenerTls, ServerTls};
pub use conn::MaybeTls;
pub(crate) use dial::dial_host;
pub use dial::{ConnectFuture, TlsIo};
pub use reload::{watch, CertExpiry, Reload, Reloads};
pub use verify::{cert_names, client_config, earliest_expiry, server_config};

use arc_swap::ArcSwap;
use rustls::{ClientConfig, ServerConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, warn};

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

/// One end of a TLS hop: the PEM settings it is built from, and what rustls builds. The
/// two ends differ only here; reloading, expiry and swapping are [`Tls`]'s, written once.
pub trait TlsEnd: Clone + Send + Sync + 'static {
    /// The rustls config of this end.
    type Config: Send + Sync + 'static;
    /// Builds the config from the PEM files.
    fn build(&self, alpn: &[&[u8]]) -> Result<Self::Config, TlsError>;
    /// Every file the config is built from (watched for changes).
    fn files(&self) -> Vec<PathBuf>;
    /// The certificate files whose expiry is exported, each with its role in the section.
    fn cert_files(&self) -> Vec<(&'static str, &Path)>;
}

impl TlsEnd for ServerTls {
    type Config = ServerConfig;

    fn build(&self, alpn: &[&[u8]]) -> Result<ServerConfig, TlsError> {
        server_config(self, alpn)
    }

    fn files(&self) -> Vec<PathBuf> {
        let mut f = vec![self.cert.clone(), self.key.clone()];
        f.extend(self.client_ca.clone());
        f
    }

    fn cert_files(&self) -> Vec<(&'static str, &Path)> {
        let mut f = vec![("cert", self.cert.as_path())];
        f.extend(self.client_ca.as_deref().map(|p| ("client_ca", p)));
        f
    }
}

impl TlsEnd for ClientTls {
    type Config = ClientConfig;

    fn build(&self, alpn: &[&[u8]]) -> Result<ClientConfig, TlsError> {
        client_config(self, alpn)
    }

    fn files(&self) -> Vec<PathBuf> {
        let mut f: Vec<PathBuf> = self.ca.iter().cloned().collect();
        f.extend(self.cert.clone());
        f.extend(self.key.clone());
        f
    }

    fn cert_files(&self) -> Vec<(&'static str, &Path)> {
        let mut f: Vec<(&'static str, &Path)> =
            self.ca.as_deref().map(|p| ("ca", p)).into_iter().collect();
        f.extend(self.cert.as_deref().map(|p| ("cert", p)));
        f
    }
}

/// The TLS config of one end of a hop, swapped on reload while it serves or dials: a
/// clone shares the config in force, so the clone given to [`watch`] reloads it for all.
#[derive(Clone)]
pub struct Tls<E: TlsEnd> {
    settings: E,
    alpn: &'static [&'static [u8]],
    current: Arc<ArcSwap<E::Config>>,
    /// The config section, for log lines and the expiry metric.
    name: &'static str,
    expiry: Option<CertExpiry>,
}

/// A listener's TLS: hands each accepted connection's handshake the config in force.
pub type TlsServer = Tls<ServerTls>;
/// A dialer's TLS: dials with the config in force (see `dial`).
pub type TlsClient = Tls<ClientTls>;

impl<E: TlsEnd> Tls<E> {
    /// Builds the config of section `name` from `settings` (reads the files).
    pub fn new(
        name: &'static str,
        settings: E,
        alpn: &'static [&'static [u8]],
    ) -> Result<Self, TlsError> {
        let config = settings.build(alpn)?;
        Ok(Tls {
            settings,
            alpn,
            current: Arc::new(ArcSwap::from_pointee(config)),
            name,
            expiry: None,
        })
    }

    /// Exports the expiry of its certificate files now and after every reload. Call it
    /// before cloning into [`watch`].
    pub fn with_expiry(mut self, expiry: &CertExpiry) -> Self {
        expiry.record(self.name, &self.settings.cert_files());
        self.expiry = Some(expiry.clone());
        self
    }

    /// The config in force (it changes on reload).
    pub fn config(&self) -> Arc<E::Config> {
        self.current.load_full()
    }
}

impl Tls<ServerTls> {
    /// An acceptor with the config in force.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current.load_full())
    }
}

impl<E: TlsEnd> Reload for Tls<E> {
    fn reload(&self) -> Result<(), TlsError> {
        self.current
            .store(Arc::new(self.settings.build(self.alpn)?));
        if let Some(e) = &self.expiry {
            e.record(self.name, &self.settings.cert_files());
        }
        Ok(())
    }

    fn files(&self) -> Vec<PathBuf> {
        self.settings.files()
    }

    fn name(&self) -> &str {
        self.name
    }
}

#[cfg(test)]
mod tests;
