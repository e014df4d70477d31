//! Tunnel ids: readable names of 1-128 bytes of `A-Z a-z 0-9 . _ -`. Every process checks
//! them where they enter it: the tunnel server parses its token store's into [`TunnelId`]s
//! (so an agent stream's tunnel id was checked when the store loaded), and the dispatcher
//! checks with [`is_valid`] the ids of report streams, of records read from Redis and of
//! its `/relay/{tunnel_id}/` paths.

/// Longest tunnel id, in bytes.
pub const MAX_LEN: usize = 128;

/// Whether `id` is a well-formed tunnel id.
pub fn is_valid(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A tunnel id that passed [`is_valid`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TunnelId(String);

/// Why a string is not a tunnel id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a tunnel id (1-{MAX_LEN} of A-Z a-z 0-9 . _ -)")]
pub struct InvalidTunnelId;

impl TunnelId {
    pub fn parse(id: &str) -> Result<Self, InvalidTunnelId> {
        if is_valid(id) {
            Ok(TunnelId(id.to_string()))
        } else {
            Err(InvalidTunnelId)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for TunnelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for TunnelId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readable_names_of_at_most_128_bytes() {
        assert!(is_valid("acme-scm.v2_x"));
        assert!(is_valid(&"a".repeat(128)));
        for bad in ["", "a/b", "a%20", "a b", "é", "a\n"] {
            assert!(!is_valid(bad), "{bad:?}");
            assert_eq!(TunnelId::parse(bad), Err(InvalidTunnelId));
        }
        assert!(!is_valid(&"a".repeat(129)));
        assert_eq!(TunnelId::parse("demo").unwrap().as_str(), "demo");
    }
}
