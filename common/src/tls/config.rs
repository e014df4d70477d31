//! The TLS sections as operators write them, checked once at start: a listener's
//! ([`ListenerTls`], resolving to [`ServerTls`]) and a dialer's ([`DialerTls`], resolving
//! to [`ClientTls`]). Plain text is always a written choice (`insecure = true`). Nothing
//! here reads a file; [`super::verify`] builds the rustls configs.

use crate::config::ConfigError;
use rustls::pki_types::ServerName;
use serde::Deserialize;
use std::path::PathBuf;

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
