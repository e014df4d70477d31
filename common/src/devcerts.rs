//! Throwaway certificate authorities and leaf certificates for tests, the demo and the
//! example TLS set (feature `dev-certs`). Keys are generated fresh each time; nothing here
//! is meant for production.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use std::path::{Path, PathBuf};

/// A generated CA that signs leaf certificates.
pub struct DevCa {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A generated leaf certificate and its key, in PEM.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl DevCa {
    pub fn new(name: &str) -> Result<Self, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        Ok(DevCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// A server certificate for `names` (DNS names or IP addresses), valid now.
    pub fn server(&self, names: &[&str]) -> Result<Leaf, rcgen::Error> {
        self.leaf(names, ExtendedKeyUsagePurpose::ServerAuth, false)
    }

    /// A client certificate with common name `name`, valid now.
    pub fn client(&self, name: &str) -> Result<Leaf, rcgen::Error> {
        self.leaf(&[name], ExtendedKeyUsagePurpose::ClientAuth, false)
    }

    /// A client certificate naming each of `names`, valid now.
    pub fn client_for(&self, names: &[&str]) -> Result<Leaf, rcgen::Error> {
        self.leaf(names, ExtendedKeyUsagePurpose::ClientAuth, false)
    }

    /// A server certificate that expired in 2021.
    pub fn expired_server(&self, names: &[&str]) -> Result<Leaf, rcgen::Error> {
        self.leaf(names, ExtendedKeyUsagePurpose::ServerAuth, true)
    }

    fn leaf(
        &self,
        names: &[&str],
        usage: ExtendedKeyUsagePurpose,
        expired: bool,
    ) -> Result<Leaf, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        for n in names {
            params
                .subject_alt_names
                .push(match n.parse::<std::net::IpAddr>() {
                    Ok(ip) => SanType::IpAddress(ip),
                    Err(_) => SanType::DnsName((*n).try_into()?),
                });
        }
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, *first);
        }
        params.extended_key_usages = vec![usage];
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// Writes `pem` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, pem: &str) -> std::io::Result<PathBuf> {
    let p = dir.join(name);
    std::fs::write(&p, pem)?;
    Ok(p)
}
