//! This dispatcher's leg to each tunnel server: every [`PROBE_EVERY`] it sends each server
//! in the table (local and shared entries) a `Forward.Probe` on the connection its calls
//! use and times the answer, smooths the samples ([`relay_common::rtt::Rtt`]: EWMA, a sample
//! capped at 4x the average, one below a quarter replaces it) and hands the result to the
//! registry, which adds it to the agent leg each server reports for a tunnel id's streams
//! (the latency tiers of `crate::routing`).
//!
//! Any answer is a round trip: a server that does not know the RPC (UNIMPLEMENTED) is
//! timed alike (`crate::pool::Remote::round_trip`). No answer within [`PROBE_TIMEOUT`] is
//! no sample, nor is a server the pool holds down (the server's lease, the pool's own probe
//! and the calls' retries deal with a dead server). The co-located server (no network) is a
//! leg of 0. Probes run one at a time per server and never on the call path.
//!
//! It must not route or decide anything: it measures.

use crate::forward::{Channels, Hop};
use crate::registry::Routes;
use relay_common::rtt::Rtt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

/// How often each server is probed.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);
/// How long one probe may take before it counts as no sample.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Probes every server of `registry` through `channels` until `stop`.
pub async fn run(routes: Arc<Routes>, channels: Channels, stop: CancellationToken) {
    let mut smoothed: HashMap<String, Rtt> = HashMap::new();
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let targets = routes.forward_targets();
        smoothed.retain(|url, _| targets.iter().any(|(_, u)| u == url));
        let probes = targets.iter().map(|(_, url)| {
            let channels = &channels;
            async move { (url, probe(channels, url).await) }
        });
        let results = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            r = futures::future::join_all(probes) => r,
        };
        for (url, sample) in results {
            let Some(sample) = sample else { continue };
            let rtt = smoothed.entry(url.clone()).or_default();
            rtt.observe_duration(sample);
            // A measured leg is never "unknown" (0): at least a microsecond.
            routes.forward_rtt(url, Some(rtt.micros().max(1)));
        }
    }
}

/// One round trip to the server at `forward_url`; `None` when it could not be timed.
async fn probe(channels: &Channels, forward_url: &str) -> Option<Duration> {
    match channels.get(forward_url).ok()? {
        Hop::Local(_) => Some(Duration::ZERO),
        Hop::Remote(remote) => remote.round_trip(PROBE_TIMEOUT).await,
    }
}
