//! Reloading from files: what can rebuild itself ([`Reload`]: a hop's [`super::Tls`], the
//! tunnel server's token store), the list a process reloads ([`Reloads`]) and the one task
//! that reloads it on SIGHUP or when a file changes ([`watch`]); and the expiry metric
//! refreshed on each reload ([`CertExpiry`]).

use super::verify::earliest_expiry;
use super::TlsError;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// `relay_tls_certificate_expiry_timestamp_seconds{section,role,file}`: when each loaded
/// certificate file stops being valid, in seconds since the Unix epoch. `section` is the
/// config section (`agent_tls`, `forward_tls`, ...), `role` what the file is in it (`cert`,
/// `ca`, `client_ca`) and `file` its path. A file holding several certificates (a chain,
/// a CA bundle) reports the earliest `notAfter` among them: the hop breaks when the first
/// one expires. Updated at start and after every successful reload.
#[derive(Clone)]
pub struct CertExpiry {
    gauge: prometheus::GaugeVec,
}

impl CertExpiry {
    /// The metric's name.
    pub const NAME: &'static str = "relay_tls_certificate_expiry_timestamp_seconds";

    /// Creates the metric and registers it on `registry`.
    pub fn register(registry: &prometheus::Registry) -> prometheus::Result<Self> {
        let gauge = prometheus::GaugeVec::new(
            prometheus::Opts::new(
                Self::NAME,
                "When a loaded certificate file expires (earliest notAfter of its certificates), seconds since the Unix epoch",
            ),
            &["section", "role", "file"],
        )?;
        registry.register(Box::new(gauge.clone()))?;
        Ok(CertExpiry { gauge })
    }

    pub(super) fn record(&self, section: &str, files: &[(&'static str, &Path)]) {
        for (role, path) in files {
            match earliest_expiry(path) {
                Ok(t) => self
                    .gauge
                    .with_label_values(&[section, role, &path.display().to_string()])
                    .set(t as f64),
                Err(e) => {
                    warn!(section, role, error = %e, "cannot read the certificate's expiry")
                }
            }
        }
    }
}

/// Something that can rebuild itself from its files.
pub trait Reload: Send + Sync {
    /// Rebuilds from the files; on error the old config stays.
    fn reload(&self) -> Result<(), TlsError>;
    /// The files it is built from (watched for changes).
    fn files(&self) -> Vec<PathBuf>;
    /// For log lines.
    fn name(&self) -> &str;
}

/// What one process reloads from files (its certificates; the tunnel server's token store
/// too), and the one task that reloads them: every binary wires reload through this.
///
/// ```ignore
/// Reloads::default()
///     .with(front_tls.clone())
///     .with(forward_tls.clone())
///     .spawn(config.reload_interval, stop.clone());
/// ```
#[derive(Default)]
pub struct Reloads(Vec<Arc<dyn Reload>>);

impl Reloads {
    /// Adds an item if there is one (a hop without TLS has nothing to reload).
    pub fn with(mut self, item: Option<impl Reload + 'static>) -> Self {
        if let Some(item) = item {
            self.0.push(Arc::new(item));
        }
        self
    }

    pub fn push(&mut self, item: impl Reload + 'static) {
        self.0.push(Arc::new(item));
    }

    /// Spawns [`watch`] over the items: each is reloaded on SIGHUP and when one of its
    /// files changes (checked every `poll`), until `stop`. New connections use what was
    /// reloaded; established ones keep theirs. The SIGHUP handler is installed before
    /// this returns.
    pub fn spawn(self, poll: Duration, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        tokio::spawn(self.run(poll, stop))
    }

    /// [`Reloads::spawn`] as a future, for a caller that spawns its tasks where it tracks
    /// them. The SIGHUP handler is installed when this is called.
    pub fn run(
        self,
        poll: Duration,
        stop: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send {
        watch(self.0, poll, stop)
    }
}

/// Reloads every item on SIGHUP, and when one of its files changes (checked every
/// `poll`), until `stop`.
///
/// The SIGHUP handler is installed when this is called, not when the future first runs,
/// and also when there is nothing to reload: a process that serves (say, its `/healthz`)
/// after calling this never dies of a SIGHUP, whose default action ends the process. With
/// nothing to reload a SIGHUP is logged and ignored.
pub fn watch(
    items: Vec<Arc<dyn Reload>>,
    poll: Duration,
    stop: CancellationToken,
) -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    let hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(h) => Some(h),
        Err(e) => {
            warn!(error = %e, "cannot listen for SIGHUP; files are still checked every reload_interval");
            None
        }
    };
    #[cfg(not(unix))]
    let hup: Option<()> = None;
    watch_files(items, poll, stop, hup)
}

#[cfg(unix)]
type Hangup = tokio::signal::unix::Signal;
#[cfg(not(unix))]
type Hangup = ();

async fn watch_files(
    items: Vec<Arc<dyn Reload>>,
    poll: Duration,
    stop: CancellationToken,
    #[cfg_attr(not(unix), allow(unused_mut, unused_variables))] mut hup: Option<Hangup>,
) {
    let stamp = |r: &Arc<dyn Reload>| -> Vec<Option<SystemTime>> {
        r.files()
            .iter()
            .map(|f| std::fs::metadata(f).and_then(|m| m.modified()).ok())
            .collect()
    };
    let mut stamps: Vec<_> = items.iter().map(stamp).collect();
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        #[cfg(unix)]
        let hup_fut = async {
            match hup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hup_fut = std::future::pending::<()>();
        // With nothing to reload there are no files to check.
        let tick_fut = async {
            if items.is_empty() {
                std::future::pending::<()>().await;
            }
            tick.tick().await;
        };
        let forced = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = hup_fut => true,
            _ = tick_fut => false,
        };
        if items.is_empty() {
            info!("SIGHUP: nothing to reload (no certificate or token store file configured)");
            continue;
        }
        let trigger = if forced { "SIGHUP" } else { "file change" };
        for (i, item) in items.iter().enumerate() {
            let now = stamp(item);
            if !forced && now == stamps[i] {
                continue;
            }
            stamps[i] = now;
            match item.reload() {
                Ok(()) => info!(what = item.name(), trigger, "reloaded from its files"),
                Err(e) => {
                    warn!(what = item.name(), trigger, error = %e, "reload failed; keeping the previous one")
                }
            }
        }
    }
}
