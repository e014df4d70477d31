//! The shared registry: keeps this dispatcher's [`Routes`] in step with the other
//! dispatchers of a fleet through Redis (`[registry] backend = "redis"`).
//!
//! One background task owns the Redis connection. It writes each local server's record
//! (`<prefix>:server:<server_id>`, sealed JSON, expiring after `lease`) whenever the server
//! reports, and lists the server id in the set `<prefix>:servers`; every
//! `refresh_interval` it reads all records back into the registry. A server that stops
//! reporting stops being rewritten, so its key expires and every dispatcher drops it
//! within `lease + refresh_interval`; the reader that finds an id without a key removes it
//! from the set and counts a lease expiry. A server that leaves this dispatcher (its report
//! stream ended, or its lease ran out here) has its record deleted and a marker
//! `<prefix>:left:<server_id>` written (expiring after `lease`).
//!
//! The call path never waits on Redis: it routes from the registry's local table. When
//! Redis is unreachable (refusing, or frozen: connections open and nothing answered, which
//! every command's `redis_timeout` bounds) the task keeps the last known shared entries,
//! reports degraded (see [`SharedHealth`], used by `/readyz`), retries with backoff, and
//! once Redis answers again rewrites every local record before anything else (keys may
//! have expired meanwhile).
//!
//! Right after an outage the other dispatchers may not have rewritten their records yet
//! (an outage longer than the lease lets every record expire, and a restarted Redis is
//! empty), so for one lease from the first successful read a missing record does not drop
//! its entry: that grace starts with the very first read (an earlier version pruned on it,
//! dropping live servers of other dispatchers until they rewrote). A server whose `left`
//! marker is there is dropped during the grace too: its dispatcher saw it go (a server that
//! crashed during the outage is gone from every dispatcher within `refresh_interval` of its
//! own dispatcher reaching Redis again, instead of a lease later).
//!
//! Records are sealed and checked on read (see [`record`]): a record written without
//! `[registry] record_key`, edited, moved or replayed, or naming a server id, tunnel id or
//! `forward_url` the rules refuse, is treated as missing, counted in
//! `relay_dispatcher_registry_records_refused_total{reason}` and logged, once per record
//! value (the same value read again on the next refresh is not counted or logged again).
//!
//! This module must not route calls; it never logs the Redis URL (it may hold a password)
//! nor the record key.

pub mod record;

use crate::config::RedisTls;
use crate::metrics::Metrics;
use crate::registry::{Prune, Publish, Routes};
use parking_lot::Mutex;
use record::{RecordRules, Refusal, MAX_READ_BYTES, MAX_RECORD_BYTES, MAX_SHARED_SERVERS};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, IntoConnectionInfo};
use relay_common::config::ConfigError;
use relay_common::Secret;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Longest wait between two reconnect attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Whether the shared registry is reachable, for `/readyz`.
#[derive(Default)]
pub struct SharedHealth {
    state: Mutex<HealthState>,
}

#[derive(Default)]
struct HealthState {
    /// Why Redis counts as down, and since when.
    degraded: Option<(String, Instant)>,
    last_ok: Option<Instant>,
}

impl SharedHealth {
    fn lock(&self) -> parking_lot::MutexGuard<'_, HealthState> {
        self.state.lock()
    }

    /// `(healthy, detail)`.
    pub fn status(&self) -> (bool, serde_json::Value) {
        let now = Instant::now();
        let s = self.lock();
        let age = |t: Instant| now.saturating_duration_since(t).as_millis() as u64;
        match &s.degraded {
            Some((why, since)) => (
                false,
                serde_json::json!({
                    "backend": "redis",
                    "state": "degraded",
                    "error": why,
                    "degraded_for_ms": age(*since),
                    "last_ok_age_ms": s.last_ok.map(age),
                    "routing": "from the last known table",
                }),
            ),
            None => (
                s.last_ok.is_some(),
                serde_json::json!({
                    "backend": "redis",
                    "state": if s.last_ok.is_some() { "ok" } else { "connecting" },
                    "last_ok_age_ms": s.last_ok.map(age),
                }),
            ),
        }
    }

    /// Marks Redis down; true when it was up before.
    fn down(&self, why: String) -> bool {
        let mut s = self.lock();
        let was_up = s.degraded.is_none();
        let since = s
            .degraded
            .as_ref()
            .map(|(_, t)| *t)
            .unwrap_or_else(Instant::now);
        s.degraded = Some((why, since));
        was_up
    }

    /// Marks Redis up; true when it was down before.
    fn up(&self) -> bool {
        let mut s = self.lock();
        s.last_ok = Some(Instant::now());
        s.degraded.take().is_some()
    }
}

/// The Redis side of the shared registry. See the module docs.
pub struct SharedStore {
    pub routes: Arc<Routes>,
    pub client: redis::Client,
    pub key_prefix: String,
    pub lease: Duration,
    pub refresh_interval: Duration,
    pub timeout: Duration,
    pub health: Arc<SharedHealth>,
    pub metrics: Metrics,
    pub stop: CancellationToken,
    /// The record key and the checks of records read back.
    pub rules: RecordRules,
}

/// Records refused on earlier reads, by server id: a fingerprint of the refused value and
/// the reason, so one bad record is counted and logged once, not on every refresh.
#[derive(Default)]
struct Refused(HashMap<String, (u64, &'static str)>);

fn fingerprint(value: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// Records refused in one read of the shared store.
#[derive(Default)]
struct Pass {
    /// Server ids refused in this read.
    seen: HashSet<String>,
    logged: usize,
    /// Refusals past [`LOGGED_PER_READ`]: counted, and summed up in one log line.
    unlogged: usize,
}

/// Refusals logged one by one per read (a flood of planted records costs one more line).
const LOGGED_PER_READ: usize = 10;

/// One record value as read: bounded in size before it is read whole.
enum Value {
    /// No such key (or an empty string).
    Missing,
    Text(String),
    /// Refused before it is opened (too large, not text, not a string), with a
    /// fingerprint of what was read.
    Refused(u64, Refusal),
}

/// Record values read per round trip (`GETRANGE` each, at most [`MAX_RECORD_BYTES`] + 1
/// bytes): what one round trip can hold in memory.
const READ_BATCH: usize = 16;

fn unix_ms_now() -> u64 {
    relay_common::wall::unix_ms()
}

#[derive(Debug, thiserror::Error)]
enum StoreError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
}

/// The Redis client for `url`: `redis://` in plain text, `rediss://` over TLS (rustls)
/// with `[registry.redis_tls]`; a user name and password in the URL
/// (`rediss://relay:pw@host:6380/0`) are sent with `AUTH <user> <password>`. Reads the
/// TLS files; errors name the key.
///
/// The commands sent, for an ACL: `AUTH` (with a password in the URL), `SELECT` (with a
/// database other than 0 in the URL), then `SET` (with `PX`), `SADD`, `SREM`, `DEL`,
/// `SMEMBERS`, `GETRANGE` and `EXISTS` on keys under the prefix.
pub fn client(url: &Secret, tls: &RedisTls) -> Result<redis::Client, ConfigError> {
    // The redis crate's own messages may quote the URL (and its password): say only which
    // kind of problem it is.
    let bad_url = |e: redis::RedisError| {
        ConfigError::invalid(
            "registry.url",
            format!("not a usable Redis URL: {:?}", e.kind()),
        )
    };
    let info = url.expose().into_connection_info().map_err(bad_url)?;
    // No `CLIENT SETINFO` after connecting: the commands the relay sends are exactly the
    // ones its documented ACL grants (see docs/routing.md, "Routing and the shared registry").
    let info = info
        .clone()
        .set_redis_settings(info.redis_settings().clone().set_skip_set_lib_name());
    if !url.expose().starts_with("rediss://") {
        return redis::Client::open(info).map_err(bad_url);
    }
    let read = |key: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| {
            ConfigError::invalid(
                format!("registry.redis_tls.{key}"),
                format!("cannot read {}: {e}", path.display()),
            )
        })
    };
    let root_cert = tls.ca.as_deref().map(|p| read("ca", p)).transpose()?;
    let client_tls = match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read("cert", cert)?,
            client_key: read("key", key)?,
        }),
        _ => None,
    };
    redis::Client::build_with_tls(
        info,
        redis::TlsCertificates {
            client_tls,
            root_cert,
        },
    )
    .map_err(|e| {
        ConfigError::invalid(
            "registry.redis_tls",
            format!("cannot set up TLS to Redis: {e}"),
        )
    })
}

impl SharedStore {
    fn set_key(&self) -> String {
        format!("{}:servers", self.key_prefix)
    }

    fn server_key(&self, server_id: &str) -> String {
        format!("{}:server:{}", self.key_prefix, server_id)
    }

    /// The marker of a server that left its dispatcher (see the module docs).
    fn left_key(&self, server_id: &str) -> String {
        format!("{}:left:{}", self.key_prefix, server_id)
    }

    async fn bounded<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, redis::RedisError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    async fn connect(&self) -> Result<MultiplexedConnection, StoreError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        self.bounded(
            self.client
                .get_multiplexed_async_connection_with_config(&config),
        )
        .await
    }

    async fn write(
        &self,
        conn: &mut MultiplexedConnection,
        items: &[Publish],
    ) -> Result<(), StoreError> {
        if items.is_empty() {
            return Ok(());
        }
        let lease_ms = self.lease.as_millis().max(1) as u64;
        let expires = unix_ms_now() + lease_ms;
        let mut pipe = redis::pipe();
        for (id, record) in items {
            match record {
                Some(r) => {
                    let key = self.server_key(id);
                    let sealed = self.rules.seal(&key, r, expires);
                    pipe.cmd("SET")
                        .arg(key)
                        .arg(sealed)
                        .arg("PX")
                        .arg(lease_ms)
                        .ignore();
                    pipe.cmd("SADD").arg(self.set_key()).arg(id).ignore();
                }
                None => {
                    pipe.cmd("DEL").arg(self.server_key(id)).ignore();
                    pipe.cmd("SREM").arg(self.set_key()).arg(id).ignore();
                    pipe.cmd("SET")
                        .arg(self.left_key(id))
                        .arg(1)
                        .arg("PX")
                        .arg(lease_ms)
                        .ignore();
                }
            }
        }
        self.bounded(pipe.query_async::<()>(conn)).await
    }

    /// Counts and logs a refused record, unless the same value was refused last time.
    fn refuse(&self, refused: &mut Refused, pass: &mut Pass, id: &str, print: u64, why: &Refusal) {
        pass.seen.insert(id.to_string());
        let mark = (print, why.reason());
        if refused.0.get(id) == Some(&mark) {
            return;
        }
        refused.0.insert(id.to_string(), mark);
        self.metrics
            .registry_records_refused
            .with_label_values(&[why.reason()])
            .inc();
        if pass.logged >= LOGGED_PER_READ {
            pass.unlogged += 1;
            return;
        }
        pass.logged += 1;
        // Debug formatting escapes whatever the id holds.
        warn!(server_id = ?id, reason = why.reason(), detail = %why,
            "refused a shared registry record: routing ignores it");
    }

    /// The values at `keys`: each read through `GETRANGE 0 MAX_RECORD_BYTES`, so a value
    /// over the bound is refused after reading one byte more than it (not whole), and no
    /// more than [`MAX_READ_BYTES`] in all per read; a key that is not a string is refused
    /// (other keys read on).
    async fn values(
        &self,
        conn: &mut MultiplexedConnection,
        keys: &[String],
    ) -> Result<Vec<Value>, StoreError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut total = 0usize;
        for batch in keys.chunks(READ_BATCH) {
            if total > MAX_READ_BYTES {
                out.extend(batch.iter().map(|_| {
                    Value::Refused(
                        0,
                        Refusal::TooLarge(format!(
                            "the records read before it pass {MAX_READ_BYTES} bytes"
                        )),
                    )
                }));
                continue;
            }
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for key in batch {
                pipe.cmd("GETRANGE").arg(key).arg(0).arg(MAX_RECORD_BYTES);
            }
            let got: Vec<redis::RedisResult<Vec<u8>>> =
                self.bounded(pipe.query_async(conn)).await?;
            for value in got {
                out.push(match value {
                    Ok(v) if v.is_empty() => Value::Missing,
                    Ok(v) if v.len() > MAX_RECORD_BYTES => Value::Refused(
                        v.len() as u64,
                        Refusal::TooLarge(format!("over {MAX_RECORD_BYTES} bytes")),
                    ),
                    Ok(v) => {
                        total += v.len();
                        match String::from_utf8(v) {
                            Ok(text) => Value::Text(text),
                            Err(_) => Value::Refused(1, Refusal::Malformed("not UTF-8".into())),
                        }
                    }
                    Err(e) => Value::Refused(2, Refusal::Malformed(format!("{:?}", e.kind()))),
                });
            }
        }
        Ok(out)
    }

    async fn read(
        &self,
        conn: &mut MultiplexedConnection,
        prune: bool,
        refused: &mut Refused,
    ) -> Result<(), StoreError> {
        let mut listed: Vec<String> = self
            .bounded(redis::cmd("SMEMBERS").arg(self.set_key()).query_async(conn))
            .await?;
        listed.sort();
        let mut pass = Pass::default();
        let mut ids = Vec::with_capacity(listed.len().min(MAX_SHARED_SERVERS));
        for id in listed {
            if let Err(why) = self.rules.check_server_id(&id) {
                self.refuse(refused, &mut pass, &id, 0, &why);
            } else if ids.len() >= MAX_SHARED_SERVERS {
                self.refuse(refused, &mut pass, &id, 0, &Refusal::TooManyServers);
            } else {
                ids.push(id);
            }
        }
        let mut records = Vec::with_capacity(ids.len());
        if !ids.is_empty() {
            let keys: Vec<String> = ids.iter().map(|id| self.server_key(id)).collect();
            let values = self.values(conn, &keys).await?;
            let mut expired = Vec::new();
            let now = unix_ms_now();
            for ((id, key), value) in ids.iter().zip(&keys).zip(values) {
                match value {
                    Value::Missing => expired.push(id.clone()),
                    Value::Refused(print, why) => self.refuse(refused, &mut pass, id, print, &why),
                    Value::Text(value) => match self.rules.open(key, id, &value, now) {
                        Ok(r) => records.push(r),
                        Err(why) => self.refuse(refused, &mut pass, id, fingerprint(&value), &why),
                    },
                }
            }
            if !expired.is_empty() {
                let removed: u64 = self
                    .bounded(
                        redis::cmd("SREM")
                            .arg(self.set_key())
                            .arg(&expired)
                            .query_async(conn),
                    )
                    .await?;
                if removed > 0 {
                    self.metrics.lease_expiries.inc_by(removed);
                    info!(servers = ?expired, "tunnel servers dropped from the shared registry: lease expired");
                }
            }
        }
        // Forget refusals of records that are gone, so a bad record written again counts.
        refused.0.retain(|id, _| pass.seen.contains(id));
        if pass.unlogged > 0 {
            warn!(
                more = pass.unlogged,
                "refused more shared registry records than are logged one by one per read \
                 (see relay_dispatcher_registry_records_refused_total)"
            );
        }
        let prune = if prune {
            Prune::Missing
        } else {
            // The grace after an outage: drop only servers known to have left.
            let listed: HashSet<&str> = records.iter().map(|r| r.info.server_id.as_str()).collect();
            let missing: Vec<String> = self
                .routes
                .shared_ids()
                .into_iter()
                .filter(|id| !listed.contains(id.as_str()))
                .collect();
            let mut left = HashSet::new();
            if !missing.is_empty() {
                // EXISTS, not the values: a marker's content does not matter.
                let mut pipe = redis::pipe();
                for id in &missing {
                    pipe.cmd("EXISTS").arg(self.left_key(id));
                }
                let marks: Vec<u64> = self.bounded(pipe.query_async(conn)).await?;
                for (id, mark) in missing.into_iter().zip(marks) {
                    if mark > 0 {
                        left.insert(id);
                    }
                }
            }
            Prune::Left(left)
        };
        self.routes.apply_shared(records, prune);
        Ok(())
    }

    /// Runs until `stop` is cancelled.
    pub async fn run(self) {
        // Every refusal reason at zero from the start, so a first refusal shows in `rate()`.
        for r in record::REFUSAL_REASONS {
            self.metrics
                .registry_records_refused
                .with_label_values(&[r]);
        }
        let mut conn: Option<MultiplexedConnection> = None;
        let mut refresh = tokio::time::interval(self.refresh_interval);
        refresh.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let mut backoff = Duration::from_millis(100);
        let mut next_try = Instant::now();
        // Rewrite every local record on the first success and after each outage.
        let mut republish = true;
        // After an outage, other dispatchers need a moment to rewrite their records (Redis
        // may have restarted empty): for one lease, missing records do not drop entries.
        let mut recovered_at: Option<Instant> = None;
        let mut was_down = false;
        let mut refused = Refused::default();
        loop {
            let mut read = false;
            tokio::select! {
                // Stop first; then local changes (they renew leases); then the read tick.
                biased;
                _ = self.stop.cancelled() => break,
                _ = self.routes.dirty_notify.notified() => {}
                _ = refresh.tick() => read = true,
            }
            if conn.is_none() && Instant::now() < next_try {
                continue;
            }
            let mut items = self.routes.take_dirty();
            if republish {
                let mut all = self.routes.local_records();
                all.retain(|(id, _)| !items.iter().any(|(i, _)| i == id));
                items.extend(all);
            }
            // The grace starts with the first read after an outage (`was_down`).
            let prune = !was_down
                && recovered_at
                    .is_none_or(|t| Instant::now().saturating_duration_since(t) >= self.lease);
            let result = self
                .sync(&mut conn, &items, read.then_some(&mut refused), prune)
                .await;
            match result {
                Ok(()) => {
                    if was_down {
                        was_down = false;
                        recovered_at = Some(Instant::now());
                    }
                    republish = false;
                    backoff = Duration::from_millis(100);
                    if self.health.up() {
                        info!("shared registry reachable again");
                    }
                    self.metrics.registry_degraded.set(0);
                }
                Err(e) => {
                    conn = None;
                    republish = true;
                    was_down = true;
                    self.routes.restore_dirty(items);
                    if self.health.down(e.to_string()) {
                        warn!(error = %e, "shared registry unreachable: routing from the last known table");
                    }
                    self.metrics.registry_degraded.set(1);
                    next_try = Instant::now() + backoff;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        // Best effort: remove the records of servers that left during shutdown.
        let items = self.routes.take_dirty();
        if !items.is_empty() {
            if let Some(mut c) = conn {
                let _ = self.write(&mut c, &items).await;
            }
        }
    }

    async fn sync(
        &self,
        conn: &mut Option<MultiplexedConnection>,
        items: &[Publish],
        read: Option<&mut Refused>,
        prune: bool,
    ) -> Result<(), StoreError> {
        let c = match conn {
            Some(c) => c,
            None => conn.insert(self.connect().await?),
        };
        self.write(c, items).await?;
        if let Some(refused) = read {
            self.read(c, prune, refused).await?;
        }
        Ok(())
    }
}
