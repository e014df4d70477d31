//! Each plan's first step: the figures and state of every server (`Planner::classify`),
//! and the memory the rules keep across plans (since when a server is short and idle,
//! draining servers counted as evacuated, fill budgets reset once covered).

use super::*;

impl Planner {
    /// Figures and state of every server with live streams; updates the memory
    /// (draining servers count as evacuated, since when a server has been short and idle,
    /// fill budgets of servers that are covered again).
    pub(super) fn classify<'a>(&mut self, snap: &'a Snapshot) -> Tick<'a> {
        let now = snap.now;
        let cfg = &self.cfg;
        let mut servers = Vec::with_capacity(snap.servers.len());
        let recently = |mem: &ServerMemory| {
            mem.evacuated_at
                .is_some_and(|at| now.saturating_duration_since(at) < cfg.evacuated_for)
        };
        // Placement shares: the load balancer places on every server that is not draining.
        let placeable = snap.servers.iter().filter(|v| !v.draining);
        let (n, placed) =
            placeable.fold((0usize, 0.0f64), |(n, p), v| (n + 1, p + v.placed.max(0.0)));
        let floor = share_floor(cfg);
        let share = |v: &ServerView| {
            if v.draining || n == 0 {
                return floor;
            }
            // A prior of one open spread evenly, so a server no open has reached yet is not
            // taken as unreachable (and one that took the only open is not the only one).
            let s = (v.placed.max(0.0) + 1.0 / n as f64) / (placed + 1.0);
            s.clamp(floor, 1.0)
        };
        for view in &snap.servers {
            let mem = self.memory.entry(key(view)).or_default();
            if view.draining {
                mem.evacuated_at = Some(now);
            }
            let live = count(view.streams.iter().filter(|st| !st.retiring).count());
            if live > 0 && std::mem::take(&mut mem.absent) {
                // Back: filled toward its reserve with a fresh budget.
                mem.fill_opens = 0;
                mem.paced_at = None;
            }
            mem.absent = live == 0;
            // A listed server with none of the agent's streams (new, or back as a new
            // instance) is filled like any other, unless it is being avoided.
            let absent_listed = live == 0 && view.listed && !view.draining && !recently(mem);
            if live == 0 && !absent_listed {
                mem.short_idle_since = None;
                continue;
            }
            servers.push(Server {
                view,
                state: State::Covered,
                live,
                in_flight: count(view.streams.iter().filter(|st| st.busy).count())
                    .max(view.peak_in_flight),
                idle: count(
                    view.streams
                        .iter()
                        .filter(|st| !st.busy && !st.retiring)
                        .count(),
                ),
                share: share(view),
            });
        }
        let recently_evacuated = |mem: Option<&ServerMemory>| {
            mem.and_then(|m| m.evacuated_at)
                .is_some_and(|at| now.saturating_duration_since(at) < cfg.evacuated_for)
        };
        let home = |s: &Server| !recently_evacuated(self.memory.get(&s.key()));
        let homes = servers.iter().filter(|s| home(s) && !s.absent()).count();
        let states: Vec<State> = servers
            .iter()
            .map(|s| {
                let evacuated = s.view.draining || (!home(s) && homes > 0);
                if evacuated {
                    State::Evacuated
                } else if s.live >= s.budget(cfg.reserve) {
                    State::Covered
                } else if s.busy() > 0 {
                    State::Growing
                } else {
                    State::Filling
                }
            })
            .collect();
        for (s, state) in servers.iter_mut().zip(states) {
            let mem = self.memory.entry(s.key()).or_default();
            s.state = state;
            if matches!(state, State::Growing | State::Filling) {
                mem.short_since.get_or_insert(now);
            } else {
                mem.short_since = None;
            }
            if !state.is_short() {
                mem.fill_opens = 0;
                mem.paced_at = None;
            }
            // Overdue is for a server holding streams that stay short; one holding none
            // has nothing to evacuate and keeps being filled.
            if state != State::Filling || s.absent() {
                mem.short_idle_since = None;
                continue;
            }
            let since = *mem.short_idle_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= cfg.grace {
                s.state = State::Overdue;
            }
        }
        // Forget servers that are gone, unless they are still to be avoided.
        self.memory.retain(|id, mem| {
            snap.servers.iter().any(|v| &key(v) == id) || recently_evacuated(Some(mem))
        });
        Tick {
            now,
            cause: snap.cause,
            opening: snap.opening,
            stalled: snap.stalled,
            servers,
        }
    }
}
