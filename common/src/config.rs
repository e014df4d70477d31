//! Config loading: TOML files whose structs use `deny_unknown_fields`, parsed once at
//! start, with errors that name the file and the key; and the command line over them
//! ([`Overrides`]): every binary's flags and `RELAY_*` variables replace the file's keys
//! the same way, then the result is validated once.

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

/// A config file with the command line over it: each binary's `main` lists its flags (clap
/// reads each from the flag or its `RELAY_*` variable) once, with the key each replaces,
/// and validates the result once.
///
/// ```ignore
/// let config: Config = Overrides::load(args.config.as_deref())?
///     .set(args.zone, |c, v| c.zone = v)
///     .list(args.dispatchers, |c, v| c.dispatchers = v)
///     .switch(args.no_coverage, |c| c.coverage.enabled = false)
///     .validate(Config::validate)?;
/// ```
///
/// The rules, the same in every binary: a flag that was given replaces the file's value (a
/// flag left out keeps it); a repeatable flag (comma-separated in its variable) replaces
/// the file's list when it names at least one value; a switch only turns something on.
/// Overrides apply in the order written, so a later one sees what an earlier one set.
#[must_use = "an override applies only once the config is taken out (validate or finish)"]
pub struct Overrides<T>(T);

impl<T> Overrides<T> {
    /// Overrides over a config already loaded.
    pub fn new(config: T) -> Self {
        Overrides(config)
    }

    /// Overrides over the config file at `path` ([`load`]; `None`: the defaults).
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError>
    where
        T: DeserializeOwned + Default,
    {
        load(path).map(Overrides)
    }

    /// A flag: when given, `apply` puts its value in the config.
    pub fn set<V>(mut self, flag: Option<V>, apply: impl FnOnce(&mut T, V)) -> Self {
        if let Some(v) = flag {
            apply(&mut self.0, v);
        }
        self
    }

    /// A repeatable flag: when it names at least one value, `apply` puts them in the config
    /// (replacing the file's list, not adding to it).
    pub fn list<V>(mut self, flag: Vec<V>, apply: impl FnOnce(&mut T, Vec<V>)) -> Self {
        if !flag.is_empty() {
            apply(&mut self.0, flag);
        }
        self
    }

    /// A switch: when on, `apply` runs.
    pub fn switch(mut self, on: bool, apply: impl FnOnce(&mut T)) -> Self {
        if on {
            apply(&mut self.0);
        }
        self
    }

    /// A step that may fail on what the overrides so far made of the config (reading a
    /// secret from the file a flag named, say).
    pub fn step(
        mut self,
        step: impl FnOnce(&mut T) -> Result<(), ConfigError>,
    ) -> Result<Self, ConfigError> {
        step(&mut self.0)?;
        Ok(self)
    }

    /// The config with every override applied, validated once by `check`.
    pub fn validate(
        self,
        check: impl FnOnce(&T) -> Result<(), ConfigError>,
    ) -> Result<T, ConfigError> {
        check(&self.0)?;
        Ok(self.0)
    }

    /// The config with every override applied, not validated (the caller validates).
    pub fn finish(self) -> T {
        self.0
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

    #[derive(Debug, Default, PartialEq)]
    struct Keys {
        zone: String,
        urls: Vec<String>,
        on: bool,
    }

    #[test]
    fn given_flags_replace_keys_and_absent_ones_keep_them() {
        let file = Keys {
            zone: "file".into(),
            urls: vec!["a".into()],
            on: false,
        };
        let kept = Overrides::new(file)
            .set(None::<String>, |c, v| c.zone = v)
            .list(Vec::<String>::new(), |c, v| c.urls = v)
            .switch(false, |c| c.on = true)
            .finish();
        assert_eq!(kept.zone, "file");
        assert_eq!(kept.urls, ["a"]);
        assert!(!kept.on);
        let replaced = Overrides::new(kept)
            .set(Some("flag".to_string()), |c, v| c.zone = v)
            .list(vec!["b".to_string(), "c".to_string()], |c, v| c.urls = v)
            .switch(true, |c| c.on = true)
            .finish();
        assert_eq!(
            replaced,
            Keys {
                zone: "flag".into(),
                urls: vec!["b".into(), "c".into()],
                on: true,
            }
        );
    }

    #[test]
    fn a_failed_step_or_check_is_the_error() {
        let refuse = |_: &Keys| Err(ConfigError::invalid("zone", "no"));
        let err = Overrides::new(Keys::default())
            .validate(refuse)
            .unwrap_err();
        assert!(err.to_string().contains("`zone`"), "{err}");
        let failed = Overrides::new(Keys::default())
            .step(|_| Err(ConfigError::invalid("token_file", "unreadable")));
        assert!(failed.is_err());
        let ok = Overrides::new(Keys::default())
            .step(|c| {
                c.on = true;
                Ok(())
            })
            .unwrap()
            .validate(|c| if c.on { Ok(()) } else { refuse(c) });
        assert!(ok.is_ok());
    }
}
