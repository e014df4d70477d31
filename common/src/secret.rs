//! Secrets. A [`Secret`] is a string this process sends (an agent token, the key a tunnel
//! server presents to dispatchers): `Debug` and `Display` show `***`. A [`KeyDigest`] is a
//! key this process checks (caller keys, the dispatcher's tunnel server key): only its
//! SHA-256 is kept, as token stores keep tokens, so memory and config dumps never hold the
//! key, and a check hashes the candidate and compares two 32-byte digests in constant
//! time, so neither the key's bytes nor its length show in the timing.

use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }

    /// The secret itself; call only where it must go on the wire.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// The SHA-256 of a key a peer must present. Deserializes from the key in clear (hashed at
/// once; the clear string is dropped) or, with [`KeyDigest::deserialize_hex`], from the
/// lowercase hex digest (`printf '%s' "$KEY" | sha256sum`).
#[derive(Clone, PartialEq, Eq)]
pub struct KeyDigest([u8; 32]);

impl KeyDigest {
    /// The digest of `key`.
    pub fn of(key: &[u8]) -> Self {
        KeyDigest(Sha256::digest(key).into())
    }

    /// From 64 hex digits.
    pub fn from_hex(hex_digest: &str) -> Result<Self, String> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_digest.trim(), &mut out)
            .map_err(|_| "must be 64 hex digits (a SHA-256 digest)".to_string())?;
        Ok(KeyDigest(out))
    }

    /// Whether `candidate` is the key: hashes it and compares the digests in constant
    /// time (the candidate's own length is the caller's to know).
    pub fn matches(&self, candidate: &[u8]) -> bool {
        let d: [u8; 32] = Sha256::digest(candidate).into();
        self.0.ct_eq(&d).into()
    }

    /// Serde: an optional key in clear; an empty key is refused.
    pub fn deserialize_clear<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Self>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        match s {
            None => Ok(None),
            Some(s) if s.is_empty() => Err(serde::de::Error::custom("must not be empty")),
            Some(s) => Ok(Some(Self::of(s.as_bytes()))),
        }
    }

    /// Serde: an optional hex SHA-256 digest of a key.
    pub fn deserialize_hex<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Self>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        s.map(|s| Self::from_hex(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

impl std::fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// SHA-256 of a token: the key under which token stores look a presented token up.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// Lowercase hex SHA-256 of a token: the form in which token stores keep secrets.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Constant-time equality of two byte strings (length is not secret).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_prints_the_secret() {
        let s = Secret::new("dev-token");
        assert_eq!(format!("{s:?} {s}"), "*** ***");
    }

    #[test]
    fn a_key_digest_matches_only_its_key_whatever_the_length() {
        let k = KeyDigest::of(b"caller-key");
        assert!(k.matches(b"caller-key"));
        for wrong in [&b""[..], b"c", b"caller-ke", b"caller-key ", b"caller-kez"] {
            assert!(!k.matches(wrong), "{wrong:?}");
        }
        assert_eq!(format!("{k:?}"), "***");
        let hex = sha256_hex(b"caller-key");
        assert_eq!(KeyDigest::from_hex(&hex).unwrap(), k);
        assert!(KeyDigest::from_hex("abc").is_err());
        assert!(KeyDigest::from_hex(&"g".repeat(64)).is_err());
    }

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
