//! Editing a token store file from the command line (`relay-tunnel-server tokens add |
//! revoke | list`): mint a token and append its entry, remove entries, list them.
//!
//! An edit never leaves a half-written store where a running server could read it: the
//! new text is checked with the parser the server uses ([`TokenStore::parse`]), written to
//! a temporary file in the store's directory, flushed to disk and renamed over the store,
//! so a reload (SIGHUP or the file watch) reads the old file or the new one. Edits are
//! serialised by an exclusive `flock` on the store's directory: two operators adding tokens
//! at once both keep theirs. Comments and layout survive (`toml_edit`); the rewritten file
//! keeps the store's owner and mode.
//!
//! The generated token is returned to the caller (which prints it once) and never written
//! anywhere: only its SHA-256 is stored. This module must not log.

use super::{valid_tunnel_id, TokenStore};
use base64::Engine as _;
use rand::RngCore as _;
use relay_common::config::ConfigError;
use relay_common::secret::sha256_hex;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use toml_edit::{ArrayOfTables, DocumentMut, Item, Table, Value};

/// Every generated token starts with this, so a leaked one is easy to recognise (secret
/// scanners, grep) and to tell from other credentials.
pub const TOKEN_PREFIX: &str = "relay_";

/// Random bytes in a generated token: 256 bits from the operating system's generator.
const TOKEN_BYTES: usize = 32;

/// Fewest hex digits `revoke --sha256` accepts as a prefix.
pub const MIN_HASH_PREFIX: usize = 8;

/// The header of a store file created by `tokens add`.
const NEW_STORE_HEADER: &str = "\
# relay token store: the SHA-256 of each agent token and the tunnel id it opens (no tokens).
# Edit with `relay-tunnel-server tokens add | revoke | list`; running tunnel servers reload
# it on SIGHUP and when it changes.
";

#[derive(Debug, thiserror::Error)]
pub enum EditError {
    // `error`, not `source`: the message carries it already, and a printed error chain
    // would repeat it.
    #[error("cannot {what} {path}: {error}")]
    Io {
        what: &'static str,
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("token store {0} does not exist")]
    Missing(PathBuf),
    #[error("token store {path} is not valid, fix it first: {error}")]
    Invalid { path: PathBuf, error: ConfigError },
    #[error("token store {0}: `tokens` must be a list of [[tokens]] tables")]
    Layout(PathBuf),
    #[error("tunnel id {0:?} is not valid: use 1-128 characters of A-Z a-z 0-9 . _ -")]
    BadTunnelId(String),
    #[error("sha256 {0:?} is not valid: give the entry's SHA-256, or at least {MIN_HASH_PREFIX} of its first hex digits (see `tokens list`)")]
    BadHash(String),
    #[error("no entry in {path} matches {what}; it holds {held}")]
    NoMatch {
        path: PathBuf,
        what: String,
        held: String,
    },
    #[error("sha256 prefix {prefix} matches {count} entries in {path}: give more digits")]
    Ambiguous {
        prefix: String,
        count: usize,
        path: PathBuf,
    },
    #[error("cannot read the operating system's random number generator: {0}")]
    Random(String),
}

/// One entry of a store: a tunnel id and the SHA-256 (lowercase hex) of its token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub tunnel_id: String,
    pub sha256: String,
}

/// What `add` did.
#[derive(Debug)]
pub struct Added {
    /// The new token: show it once, store it nowhere.
    pub token: String,
    pub entry: Entry,
    /// The store did not exist and was created.
    pub created: bool,
    /// Entries the tunnel id now has, this one included (more than one while rotating).
    pub tokens_of_tunnel: usize,
}

/// A strong random token: [`TOKEN_PREFIX`] and 256 bits from the operating system's
/// generator, base64url without padding (49 printable ASCII characters).
pub fn generate_token() -> Result<String, EditError> {
    let mut bytes = [0u8; TOKEN_BYTES];
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| EditError::Random(e.to_string()))?;
    Ok(format!(
        "{TOKEN_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    ))
}

/// Generates a token for `tunnel_id` and appends its entry to the store at `path`
/// (created when missing, with its directory required to exist).
pub fn add(path: &Path, tunnel_id: &str) -> Result<Added, EditError> {
    if !valid_tunnel_id(tunnel_id) {
        return Err(EditError::BadTunnelId(tunnel_id.to_string()));
    }
    let token = generate_token()?;
    let entry = Entry {
        tunnel_id: tunnel_id.to_string(),
        sha256: sha256_hex(token.as_bytes()),
    };
    let mut created = false;
    let mut tokens_of_tunnel = 0;
    edit(path, true, |doc, existed| {
        created = !existed;
        // Comments after the last entry (or a file of comments only) stay above the new
        // entry, which goes last.
        let trailing = doc.trailing().as_str().unwrap_or("").to_string();
        let note = format!(
            "{trailing}{}\n# {tunnel_id}: added {} by `relay-tunnel-server tokens add`\n",
            if existed { "" } else { NEW_STORE_HEADER },
            humantime::format_rfc3339_seconds(relay_common::wall::now())
        );
        let mut table = Table::new();
        table.insert("tunnel_id", toml_edit::value(tunnel_id));
        table.insert("sha256", toml_edit::value(entry.sha256.as_str()));
        match doc.get_mut("tokens") {
            None => {
                table.decor_mut().set_prefix(note);
                let mut list = ArrayOfTables::new();
                list.push(table);
                doc.insert("tokens", Item::ArrayOfTables(list));
                doc.set_trailing("");
            }
            Some(Item::ArrayOfTables(list)) => {
                table.decor_mut().set_prefix(note);
                list.push(table);
                doc.set_trailing("");
            }
            Some(Item::Value(Value::Array(list))) => {
                list.push(table.into_inline_table());
            }
            Some(_) => return Err(EditError::Layout(path.to_path_buf())),
        }
        tokens_of_tunnel = entries_of(doc, path)?
            .iter()
            .filter(|e| e.tunnel_id == tunnel_id)
            .count();
        Ok(())
    })?;
    Ok(Added {
        token,
        entry,
        created,
        tokens_of_tunnel,
    })
}

/// Removes the entries matching every given selector: all tokens of `tunnel_id`, or the
/// one whose SHA-256 is (or starts with, at least [`MIN_HASH_PREFIX`] digits) `sha256`.
/// Returns the removed entries; none matching is an error naming what the store holds.
pub fn revoke(
    path: &Path,
    tunnel_id: Option<&str>,
    sha256: Option<&str>,
) -> Result<Vec<Entry>, EditError> {
    let sha256 = sha256.map(normalize_hash).transpose()?;
    if let Some(id) = tunnel_id {
        if !valid_tunnel_id(id) {
            return Err(EditError::BadTunnelId(id.to_string()));
        }
    }
    let mut removed = Vec::new();
    edit(path, false, |doc, _| {
        let entries = entries_of(doc, path)?;
        if let Some(prefix) = &sha256 {
            let hits = entries
                .iter()
                .filter(|e| e.sha256.starts_with(prefix.as_str()))
                .filter(|e| tunnel_id.is_none_or(|id| e.tunnel_id == id))
                .count();
            if hits > 1 && prefix.len() < 64 {
                return Err(EditError::Ambiguous {
                    prefix: prefix.clone(),
                    count: hits,
                    path: path.to_path_buf(),
                });
            }
        }
        let matches = |e: &Entry| {
            tunnel_id.is_none_or(|id| e.tunnel_id == id)
                && sha256.as_deref().is_none_or(|p| e.sha256.starts_with(p))
        };
        removed = entries.iter().filter(|e| matches(e)).cloned().collect();
        if removed.is_empty() {
            let what = match (tunnel_id, &sha256) {
                (Some(id), Some(h)) => format!("tunnel id {id:?} with sha256 {h}"),
                (Some(id), None) => format!("tunnel id {id:?}"),
                (None, Some(h)) => format!("sha256 {h}"),
                (None, None) => "nothing (give --tunnel-id or --sha256)".into(),
            };
            return Err(EditError::NoMatch {
                path: path.to_path_buf(),
                what,
                held: describe(&entries),
            });
        }
        let keep: Vec<bool> = entries.iter().map(|e| !matches(e)).collect();
        match doc.get_mut("tokens") {
            Some(Item::ArrayOfTables(list)) => {
                // The first entry's comments hold the file's header too: keep the header
                // when that entry goes (comments right above an entry go with it).
                let header = list
                    .get(0)
                    .filter(|_| !keep[0])
                    .and_then(|t| t.decor().prefix())
                    .and_then(|p| p.as_str())
                    .map(|p| file_header(p).to_string())
                    .unwrap_or_default();
                let mut i = 0;
                list.retain(|_| {
                    i += 1;
                    keep[i - 1]
                });
                if !header.is_empty() {
                    match list.get_mut(0) {
                        Some(first) => {
                            let own = first
                                .decor()
                                .prefix()
                                .and_then(|p| p.as_str())
                                .unwrap_or("")
                                .to_string();
                            let gap = if own.starts_with('\n') { "" } else { "\n" };
                            first.decor_mut().set_prefix(format!("{header}{gap}{own}"));
                        }
                        None => {
                            let trailing = doc.trailing().as_str().unwrap_or("").to_string();
                            doc.set_trailing(format!("{header}{trailing}"));
                        }
                    }
                }
            }
            Some(Item::Value(Value::Array(list))) => {
                let mut i = 0;
                list.retain(|_| {
                    i += 1;
                    keep[i - 1]
                });
            }
            _ => return Err(EditError::Layout(path.to_path_buf())),
        }
        Ok(())
    })?;
    Ok(removed)
}

/// The store's entries, in file order.
pub fn list(path: &Path) -> Result<Vec<Entry>, EditError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(EditError::Missing(path.to_path_buf()))
        }
        Err(error) => {
            return Err(EditError::Io {
                what: "read",
                path: path.to_path_buf(),
                error,
            })
        }
    };
    let doc = parse_checked(&text, path)?;
    entries_of(&doc, path)
}

/// The part of an entry's leading comments that belongs to the file, not the entry:
/// everything up to the last blank line (the entry's own comments follow it directly).
fn file_header(prefix: &str) -> &str {
    match prefix.rfind("\n\n") {
        Some(i) => &prefix[..i + 1],
        None => "",
    }
}

/// "2 entries: acme-scm (1), demo (1)" for error messages.
fn describe(entries: &[Entry]) -> String {
    if entries.is_empty() {
        return "no entries".into();
    }
    let mut ids: Vec<(&str, usize)> = Vec::new();
    for e in entries {
        match ids.iter_mut().find(|(id, _)| *id == e.tunnel_id) {
            Some((_, n)) => *n += 1,
            None => ids.push((&e.tunnel_id, 1)),
        }
    }
    let ids: Vec<String> = ids.iter().map(|(id, n)| format!("{id} ({n})")).collect();
    format!(
        "{} entr{}: {}",
        entries.len(),
        if entries.len() == 1 { "y" } else { "ies" },
        ids.join(", ")
    )
}

fn normalize_hash(h: &str) -> Result<String, EditError> {
    let n = h.trim().to_ascii_lowercase();
    if n.len() < MIN_HASH_PREFIX || n.len() > 64 || !n.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(EditError::BadHash(h.to_string()));
    }
    Ok(n)
}

/// Parses a store with the server's parser first (so an edit starts from a store the
/// server accepts, and errors name the key), then as an editable document.
fn parse_checked(text: &str, path: &Path) -> Result<DocumentMut, EditError> {
    TokenStore::parse(text, path).map_err(|error| EditError::Invalid {
        path: path.to_path_buf(),
        error,
    })?;
    text.parse::<DocumentMut>().map_err(|e| EditError::Invalid {
        path: path.to_path_buf(),
        error: ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim().replace('\n', " "),
        },
    })
}

fn entries_of(doc: &DocumentMut, path: &Path) -> Result<Vec<Entry>, EditError> {
    let field = |get: &dyn Fn(&str) -> Option<String>| -> Result<Entry, EditError> {
        match (get("tunnel_id"), get("sha256")) {
            (Some(tunnel_id), Some(sha256)) => Ok(Entry {
                tunnel_id,
                sha256: sha256.trim().to_ascii_lowercase(),
            }),
            _ => Err(EditError::Layout(path.to_path_buf())),
        }
    };
    match doc.get("tokens") {
        None => Ok(Vec::new()),
        Some(Item::ArrayOfTables(list)) => list
            .iter()
            .map(|t| field(&|k| t.get(k).and_then(|v| v.as_str()).map(str::to_string)))
            .collect(),
        Some(Item::Value(Value::Array(list))) => list
            .iter()
            .map(|v| match v.as_inline_table() {
                Some(t) => field(&|k| t.get(k).and_then(|v| v.as_str()).map(str::to_string)),
                None => Err(EditError::Layout(path.to_path_buf())),
            })
            .collect(),
        Some(_) => Err(EditError::Layout(path.to_path_buf())),
    }
}

/// Runs `change` on the store under the directory lock and replaces the file atomically.
/// `create`: a missing store starts empty (with a header) instead of being an error.
fn edit(
    path: &Path,
    create: bool,
    change: impl FnOnce(&mut DocumentMut, bool) -> Result<(), EditError>,
) -> Result<(), EditError> {
    let io = |what: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |error| EditError::Io {
            what,
            path: p,
            error,
        }
    };
    // Edit the file a symlink points at, not the link.
    let path = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => path.to_path_buf(),
        Err(e) => return Err(io("resolve", path)(e)),
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let dir_handle = std::fs::File::open(&dir).map_err(io("open the directory of", &path))?;
    rustix::fs::flock(&dir_handle, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| io("lock the directory of", &path)(e.into()))?;

    let (text, meta) = match std::fs::read_to_string(&path) {
        Ok(t) => {
            let meta = std::fs::metadata(&path).map_err(io("read", &path))?;
            (t, Some(meta))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => (String::new(), None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(EditError::Missing(path.clone()))
        }
        Err(e) => return Err(io("read", &path)(e)),
    };
    let mut doc = parse_checked(&text, &path)?;
    change(&mut doc, meta.is_some())?;
    let new_text = doc.to_string();
    // What a server will read must load: check it with the server's own parser.
    TokenStore::parse(&new_text, &path).map_err(|error| EditError::Invalid {
        path: path.clone(),
        error,
    })?;

    let mut tmp = tempfile::Builder::new()
        .prefix(".relay-tokens-")
        .suffix(".tmp")
        .tempfile_in(&dir)
        .map_err(io("create a temporary file next to", &path))?;
    {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let file = tmp.as_file();
        let mode = meta.as_ref().map_or(0o644, |m| m.mode() & 0o7777);
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(io("set the mode of the new", &path))?;
        if let Some(m) = &meta {
            let mine = file.metadata().map_err(io("write", &path))?;
            if (mine.uid(), mine.gid()) != (m.uid(), m.gid()) {
                std::os::unix::fs::fchown(file, Some(m.uid()), Some(m.gid())).map_err(|e| {
                    io("keep the owner (uid/gid of the old file) of", &path)(std::io::Error::new(
                        e.kind(),
                        format!("{e}: run as its owner or as root"),
                    ))
                })?;
            }
        }
    }
    tmp.write_all(new_text.as_bytes())
        .map_err(io("write", &path))?;
    tmp.as_file().sync_all().map_err(io("write", &path))?;
    tmp.persist(&path)
        .map_err(|e| io("replace", &path)(e.error))?;
    // The rename itself must reach the disk before we say it is done.
    dir_handle
        .sync_all()
        .map_err(io("sync the directory of", &path))?;
    Ok(())
}

#[cfg(test)]
mod tests;
