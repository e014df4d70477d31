//! Building rustls configs from PEM files, and verifying peers past what rustls checks:
//! a mutual-TLS listener's pinned client names ([`cert_names`], `client_names`), and a
//! certificate file's expiry ([`earliest_expiry`]). Reads files; holds no state.

use super::{ClientTls, ServerTls, TlsError};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use std::path::Path;
use std::sync::Arc;

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
