//! A caller's calls in flight per tunnel id (`[[callers]] max_concurrent_calls_per_tunnel`):
//! the front takes a slot before forwarding and the call's guard gives it back when the call
//! ends, however it ends.

use std::sync::Arc;

/// Calls in flight of one caller per tunnel id. An entry lives while its count is above
/// zero, so the table holds at most `max_concurrent_calls` entries.
#[derive(Default)]
pub struct TunnelQuota {
    counts: parking_lot::Mutex<std::collections::HashMap<String, usize>>,
}

impl TunnelQuota {
    pub fn try_take(self: &Arc<Self>, tunnel_id: &str, max: usize) -> Option<TunnelPermit> {
        let mut counts = self.counts.lock();
        let n = counts.entry(tunnel_id.to_string()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(TunnelPermit {
            quota: self.clone(),
            tunnel_id: tunnel_id.to_string(),
        })
    }
}

/// One call's place among its caller's calls to one tunnel id; given back on drop.
pub struct TunnelPermit {
    quota: Arc<TunnelQuota>,
    tunnel_id: String,
}

impl Drop for TunnelPermit {
    fn drop(&mut self) {
        let mut counts = self.quota.counts.lock();
        if let Some(n) = counts.get_mut(&self.tunnel_id) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.tunnel_id);
            }
        }
    }
}
