//! The token store: maps the SHA-256 of an agent's secret token to its public tunnel id.
//!
//! Only hashes are stored; the secret is hashed on arrival and never kept, logged, or put
//! in a label. A presented token is looked up by its SHA-256 digest in a hash map: one
//! lookup per stream open whatever the size of the store. The lookup's timing can depend
//! only on the presented token's digest (and the map's random hash keys), and nobody can
//! steer a digest toward a stored one without a preimage, so timing tells nothing about
//! the stored tokens. (An earlier version compared the digest in constant time against
//! every entry: a linear scan per open that took a sixth of a fleet process's CPU at 3,000
//! tunnel ids, and a reload's revocation sweep of streams x entries.)
//!
//! [`SharedTokens`] is the live store the `Tunnel.Connect` handler reads; [`TokenReloader`]
//! swaps it when the file changes or on SIGHUP (driven by `relay_common::tls::watch`) and
//! then calls back so streams of removed tokens can be closed. A file that fails to load
//! on reload leaves the previous store in place.
//!
//! Revocation and new streams: `Tunnel.Connect` looks the token up, builds the stream,
//! registers it in the hub, and then checks the token again against the live store. A
//! reload swaps the store first and sweeps the hub second. So a stream registered before
//! the swap is in the hub when the sweep runs (and is closed by it), and a stream
//! registered after the swap fails the second check (and is refused): once a reload that
//! removed a token returns, no stream of that token is left or can be added. Holding the
//! store's lock across registration would do the same but would nest the store lock and
//! the hub's locks in both orders.
//!
//! `edit` changes a store file from the command line (`relay-tunnel-server tokens ...`).

pub mod edit;

use parking_lot::RwLock;
use relay_common::config::ConfigError;
use relay_common::secret::sha256;
use relay_common::tunnel_id::TunnelId;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoreFile {
    #[serde(default)]
    tokens: Vec<Entry>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    tunnel_id: String,
    /// Lowercase hex SHA-256 of the token.
    sha256: String,
}

/// The store as loaded: each token hash and the tunnel id it opens, parsed once here, at
/// the boundary where a tunnel id enters the server.
#[derive(Debug, Clone, Default)]
pub struct TokenStore {
    entries: HashMap<[u8; 32], TunnelId>,
}

impl TokenStore {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        let file: StoreFile = relay_common::config::parse(text, origin)?;
        let mut entries: HashMap<[u8; 32], TunnelId> = HashMap::with_capacity(file.tokens.len());
        let mut first_of: HashMap<[u8; 32], usize> = HashMap::with_capacity(file.tokens.len());
        for (i, e) in file.tokens.into_iter().enumerate() {
            let mut hash = [0u8; 32];
            if hex::decode_to_slice(e.sha256.trim(), &mut hash).is_err() {
                return Err(ConfigError::invalid(
                    format!("tokens[{i}].sha256"),
                    "must be 64 hex digits (the SHA-256 of the token)",
                ));
            }
            let Ok(tunnel_id) = TunnelId::parse(&e.tunnel_id) else {
                return Err(ConfigError::invalid(
                    format!("tokens[{i}].tunnel_id"),
                    "must be 1-128 characters of A-Z a-z 0-9 . _ -",
                ));
            };
            match entries.get(&hash) {
                None => {
                    first_of.insert(hash, i);
                    entries.insert(hash, tunnel_id);
                }
                // The same token listed twice for the same tunnel id opens the same thing.
                Some(id) if *id == tunnel_id => {}
                Some(_) => {
                    let first = first_of.get(&hash).copied().unwrap_or_default();
                    return Err(ConfigError::invalid(
                        format!("tokens[{i}].sha256"),
                        format!(
                            "is the same token hash as tokens[{first}].sha256 with another tunnel id: one token opens one tunnel id"
                        ),
                    ));
                }
            }
        }
        Ok(TokenStore { entries })
    }

    /// A store holding one token, for demos and tests.
    ///
    /// # Panics
    /// When `tunnel_id` is not a tunnel id ([`TunnelId::parse`]): demos and tests name
    /// their own.
    pub fn single(token: &str, tunnel_id: &str) -> Self {
        let mut store = TokenStore::default();
        store.add(token, tunnel_id);
        store
    }

    /// Adds a token; a token already in the store keeps its tunnel id.
    ///
    /// # Panics
    /// When `tunnel_id` is not a tunnel id ([`TunnelId::parse`]), as [`TokenStore::single`].
    pub fn add(&mut self, token: &str, tunnel_id: &str) {
        let tunnel_id = TunnelId::parse(tunnel_id)
            .unwrap_or_else(|e| panic!("TokenStore::add({tunnel_id:?}): {e}"));
        self.entries
            .entry(sha256(token.as_bytes()))
            .or_insert(tunnel_id);
    }

    /// The tunnel id of a presented token, if any.
    pub fn lookup(&self, token: &str) -> Option<&str> {
        self.lookup_entry(token).map(|(_, id)| id.as_str())
    }

    /// The stored hash and tunnel id of a presented token, if any.
    pub fn lookup_entry(&self, token: &str) -> Option<([u8; 32], &TunnelId)> {
        let presented = sha256(token.as_bytes());
        self.entries.get(&presented).map(|id| (presented, id))
    }

    /// Whether the store still maps this token hash to this tunnel id.
    pub fn contains(&self, hash: &[u8; 32], tunnel_id: &str) -> bool {
        self.entries
            .get(hash)
            .is_some_and(|id| id.as_str() == tunnel_id)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The live token store, shared by every `Tunnel.Connect` and swapped on reload.
#[derive(Clone, Default)]
pub struct SharedTokens {
    inner: Arc<RwLock<TokenStore>>,
    /// Runs once right after the next lookup: lets a test land a reload in the window
    /// between a stream's token lookup and its registration.
    #[cfg(test)]
    after_lookup: Arc<parking_lot::Mutex<Option<Hook>>>,
}

#[cfg(test)]
type Hook = Box<dyn FnOnce() + Send>;

impl SharedTokens {
    pub fn new(store: TokenStore) -> Self {
        SharedTokens {
            inner: Arc::new(RwLock::new(store)),
            #[cfg(test)]
            after_lookup: Arc::default(),
        }
    }

    /// The stored hash and tunnel id of a presented token, if any.
    pub fn lookup(&self, token: &str) -> Option<([u8; 32], TunnelId)> {
        let found = {
            let store = self.inner.read();
            store
                .lookup_entry(token)
                .map(|(hash, id)| (hash, id.clone()))
        };
        #[cfg(test)]
        {
            let hook = self.after_lookup.lock().take();
            if let Some(hook) = hook {
                hook();
            }
        }
        found
    }

    /// Whether the token hash still opens this tunnel id.
    pub fn contains(&self, hash: &[u8; 32], tunnel_id: &str) -> bool {
        let store = self.inner.read();
        store.contains(hash, tunnel_id)
    }

    /// Replaces the store (new streams see it at once).
    pub fn replace(&self, store: TokenStore) {
        *self.inner.write() = store;
    }

    pub fn len(&self) -> usize {
        self.inner.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Reloads a [`SharedTokens`] from its file, then runs `on_change` (which closes the
/// streams of removed tokens). Driven by `relay_common::tls::watch`.
pub struct TokenReloader {
    pub path: PathBuf,
    pub tokens: SharedTokens,
    pub on_change: Box<dyn Fn() + Send + Sync>,
}

impl relay_common::tls::Reload for TokenReloader {
    fn reload(&self) -> Result<(), relay_common::tls::TlsError> {
        let store = TokenStore::load(&self.path)
            .map_err(|e| relay_common::tls::TlsError::Other(e.to_string()))?;
        self.tokens.replace(store);
        (self.on_change)();
        Ok(())
    }

    fn files(&self) -> Vec<PathBuf> {
        vec![self.path.clone()]
    }

    fn name(&self) -> &str {
        "token_store"
    }
}

pub use relay_common::tunnel_id::is_valid as valid_tunnel_id;

#[cfg(test)]
mod revocation_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use relay_common::secret::sha256_hex;

    fn store_text(entries: &[(&str, &str)]) -> String {
        entries
            .iter()
            .map(|(id, token)| {
                format!(
                    "[[tokens]]\ntunnel_id = \"{id}\"\nsha256 = \"{}\"\n",
                    sha256_hex(token.as_bytes())
                )
            })
            .collect()
    }

    #[test]
    fn finds_each_of_many_tokens_and_checks_their_tunnel_id() {
        let entries: Vec<(String, String)> = (0..10_000)
            .map(|i| (format!("demo-{i}"), format!("dev-token-{i}")))
            .collect();
        let refs: Vec<(&str, &str)> = entries
            .iter()
            .map(|(id, t)| (id.as_str(), t.as_str()))
            .collect();
        let store = TokenStore::parse(&store_text(&refs), Path::new("tokens.toml")).unwrap();
        assert_eq!(store.len(), 10_000);
        for (id, token) in entries.iter().step_by(997) {
            let (hash, found) = store.lookup_entry(token).unwrap();
            assert_eq!(found.as_str(), id);
            assert!(store.contains(&hash, id));
            assert!(!store.contains(&hash, "demo"), "another tunnel id");
        }
        assert_eq!(store.lookup("dev-token-10000"), None);
    }

    #[test]
    fn one_token_for_two_tunnel_ids_names_the_key() {
        let text = store_text(&[("a", "t1"), ("b", "t2"), ("a", "t1"), ("c", "t2")]);
        let err = TokenStore::parse(&text, Path::new("tokens.toml")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("tokens[3].sha256"), "{msg}");
        assert!(msg.contains("tokens[1].sha256"), "{msg}");
        // The same token twice for the same tunnel id is accepted.
        let store =
            TokenStore::parse(&store_text(&[("a", "t1"), ("a", "t1")]), Path::new("t")).unwrap();
        assert_eq!(store.lookup("t1"), Some("a"));
    }

    #[test]
    fn finds_a_token_by_hash_and_refuses_others() {
        let text = format!(
            "[[tokens]]\ntunnel_id = \"demo\"\nsha256 = \"{}\"\n",
            sha256_hex(b"dev-token")
        );
        let store = TokenStore::parse(&text, Path::new("tokens.toml")).unwrap();
        assert_eq!(store.lookup("dev-token"), Some("demo"));
        assert_eq!(store.lookup("dev-token2"), None);
        assert_eq!(store.lookup(""), None);
    }

    #[test]
    fn bad_hash_names_the_key() {
        let err = TokenStore::parse(
            "[[tokens]]\ntunnel_id = \"demo\"\nsha256 = \"xyz\"\n",
            Path::new("tokens.toml"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("tokens[0].sha256"), "{err}");
    }
}
