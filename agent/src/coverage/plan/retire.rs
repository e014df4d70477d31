//! Retirement (`Planner::retire`): idle streams unused for `retire_unused` go in batches
//! while no server is short, and the oldest idle streams anywhere go above `max_streams`.

use super::*;

impl Planner {
    /// Retire idle streams unused for `retire_unused` (none while any server is short), in
    /// batches (see the module docs), then obey `max_streams` by retiring the oldest idle
    /// streams anywhere.
    pub(super) fn retire(&self, tick: &Tick, plan: &mut Plan) {
        let cfg = &self.cfg;
        let now = tick.now;
        let mut closing: HashSet<StreamId> = plan.close.iter().copied().collect();
        if !tick.servers.iter().any(Server::is_short) {
            let window = self.retire_window();
            let qualifies_at = |st: &StreamView| {
                (st.opened_at + cfg.retire_min_age).max(st.last_used + cfg.retire_unused)
            };
            let mut due: Vec<(&Server, Vec<StreamId>)> = Vec::new();
            let mut first_due: Option<Instant> = None;
            let mut soon = false;
            for s in tick.servers.iter().filter(|s| s.state == State::Covered) {
                let closing_here = s.view.streams.iter().filter(|st| closing.contains(&st.id));
                let spare =
                    s.live
                        .saturating_sub(s.budget(cfg.reserve))
                        .saturating_sub(count(closing_here.count())) as usize;
                let mut ids = Vec::new();
                for st in s
                    .idle_streams()
                    .into_iter()
                    .filter(|st| !closing.contains(&st.id))
                    .take(spare)
                {
                    let at = qualifies_at(st);
                    if at <= now {
                        ids.push(st.id);
                        first_due = Some(first_due.map_or(at, |f| f.min(at)));
                    } else if at <= now + window {
                        soon = true;
                    }
                }
                if !ids.is_empty() {
                    due.push((s, ids));
                }
            }
            let waited = first_due.is_some_and(|f| now.saturating_duration_since(f) >= window);
            if !soon || waited {
                for (s, unused) in due {
                    let reason = format!(
                        "streams {} > busy {} + reserve {}: retiring {} idle unused for {}s",
                        s.live,
                        s.busy(),
                        cfg.reserve,
                        unused.len(),
                        cfg.retire_unused.as_secs()
                    );
                    closing.extend(&unused);
                    plan.close_on(&s.view.server_id, ActionKind::Retire, unused, reason);
                }
            }
        }
        let live = tick.live().saturating_sub(count(closing.len()));
        let excess = live.saturating_sub(cfg.max_streams) as usize;
        if excess == 0 {
            return;
        }
        let mut oldest: Vec<(&Server, &StreamView)> = tick
            .servers
            .iter()
            .flat_map(|s| s.idle_streams().into_iter().map(move |st| (s, st)))
            .filter(|(_, st)| !closing.contains(&st.id))
            .collect();
        oldest.sort_by_key(|(_, st)| (st.opened_at, st.id));
        oldest.truncate(excess);
        let mut per_server: Vec<(&str, u32)> = Vec::new();
        for (s, st) in &oldest {
            plan.close.push(st.id);
            match per_server
                .iter_mut()
                .find(|(id, _)| *id == s.view.server_id)
            {
                Some((_, n)) => *n += 1,
                None => per_server.push((&s.view.server_id, 1)),
            }
        }
        for (server_id, n) in per_server {
            plan.actions.push(Action {
                server_id: server_id.to_string(),
                kind: ActionKind::Retire,
                count: n,
                direct: false,
                reason: format!(
                    "over cap: live {live} > max_streams {}: retiring {n} oldest idle",
                    cfg.max_streams
                ),
            });
        }
    }
}
