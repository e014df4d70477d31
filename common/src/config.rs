//! Config loading: TOML files whose structs use `deny_unknown_fields`, parsed once at
//! start, with errors that name the file and the key.

use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
}

impl ConfigError {
    pub fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// Parses a TOML document. `origin` names where it came from in errors.
pub fn parse<T: DeserializeOwned>(text: &str, origin: &Path) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: origin.to_path_buf(),
        // toml's message names the key and the line ("unknown field `x`, expected one of ...").
        message: e.to_string().trim().replace('\n', " "),
    })
}

/// Reads and parses a TOML config file; `None` gives the defaults (`T: Default`).
pub fn load<T: DeserializeOwned + Default>(path: Option<&Path>) -> Result<T, ConfigError> {
    match path {
        None => Ok(T::default()),
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                path: p.to_path_buf(),
                source,
            })?;
            parse(&text, p)
        }
    }
}

/// Reads `RELAY_<NAME>` and parses it, naming the variable on error.
pub fn env_override<T: std::str::FromStr>(name: &str) -> Result<Option<T>, ConfigError>
where
    T::Err: std::fmt::Display,
{
    let var = format!("RELAY_{name}");
    match std::env::var(&var) {
        Ok(v) => v.parse().map(Some).map_err(|e: T::Err| ConfigError::Env {
            var,
            message: e.to_string(),
        }),
        Err(_) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        #[allow(dead_code)]
        name: Option<String>,
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse::<Sample>("nmae = \"x\"", Path::new("a.toml")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("a.toml"), "{msg}");
        assert!(msg.contains("nmae"), "{msg}");
    }
}
