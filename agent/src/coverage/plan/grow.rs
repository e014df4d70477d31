//! Opens: the growth of busy servers (`Planner::grow`), the bootstrap when no server is
//! known (`Planner::bootstrap`), and the sum of every request capped at `max_streams`,
//! with room made at the cap by recycling the best-covered server's idle streams
//! (`Planner::open`, `Planner::make_room`).

use super::*;

impl Planner {
    /// Growing: the growth (the shortfall when the queue is reported, else
    /// `max(grow_min, in flight, shortfall)`) divided by the placement share, clipped by the
    /// 4x rule and `max_inflight`; a direct step is the shortfall. Busiest server first.
    pub(super) fn grow(&self, tick: &Tick) -> Vec<OpenRequest> {
        let cfg = &self.cfg;
        let reserve = cfg.reserve;
        let mut headroom = cfg.max_inflight.saturating_sub(tick.in_flight());
        let mut growing: Vec<&Server> = tick
            .servers
            .iter()
            .filter(|s| s.state == State::Growing)
            .collect();
        growing.sort_by_key(|s| std::cmp::Reverse(s.busy()));
        let mut requests = Vec::new();
        // Load-balanced opens asked for so far in this plan: a share of them lands on each
        // server, so the next server needs that much less.
        let mut planned = 0u32;
        for s in growing {
            if headroom == 0 {
                break;
            }
            let queued = s.view.queued.min(headroom);
            let demand = s.in_flight.saturating_add(queued);
            let mut target = demand.saturating_add(reserve);
            if let Some(cap) = s.view.cap {
                target = target.min(cap);
            }
            let shortfall = target.saturating_sub(s.live);
            let direct = self.direct_of(s);
            headroom -= queued;
            // A direct open lands exactly where it is needed: the shortfall and no more.
            // Through the load balancer the server gains its growth only at its share of
            // the opens; without a reported queue the growth doubles it (the queue may be
            // anything).
            let (step, rule) = if direct.is_some() {
                (shortfall, format!("direct step = shortfall {shortfall}"))
            } else {
                let (growth, how) = if s.view.hints {
                    let g = cfg.grow_min.max(shortfall);
                    (
                        g,
                        format!("growth max({}, {shortfall}) = {g}", cfg.grow_min),
                    )
                } else {
                    let g = cfg.grow_min.max(s.in_flight).max(shortfall);
                    (
                        g,
                        format!(
                            "queue not reported: growth max({}, {}, {shortfall}) = {g}",
                            cfg.grow_min, s.in_flight
                        ),
                    )
                };
                let growth = growth.min(headroom.saturating_add(queued).saturating_add(reserve));
                let landing = landing_of(planned, s.share);
                let opens = opens_for(growth.saturating_sub(landing), s.share);
                let of_others = if landing > 0 {
                    format!(", {landing} of the plan's other opens land there")
                } else {
                    String::new()
                };
                (
                    opens,
                    format!(
                        "{how}; placement share {:.2}{of_others}: {opens} opens",
                        s.share
                    ),
                )
            };
            let elsewhere: u32 = tick
                .servers
                .iter()
                .filter(|t| t.key() != s.key() && t.state != State::Evacuated)
                .map(|t| t.surplus(reserve))
                .sum();
            // Direct opens land where they are needed: the 4x rule, which bounds what
            // load-balanced opens park elsewhere, does not apply to them.
            let allowed = if direct.is_some() {
                u32::MAX
            } else {
                cfg.idle_elsewhere_factor
                    .saturating_mul(demand)
                    .saturating_sub(elsewhere)
            };
            let want = step.min(allowed);
            if want == 0 {
                continue;
            }
            if direct.is_none() {
                planned = planned.saturating_add(want);
            }
            let mut why = format!(
                "short {}: streams {} < busy {} (in flight {}, queued {}) + reserve {reserve}; {rule}",
                s.shortfall(reserve),
                s.live,
                s.busy(),
                s.in_flight,
                s.view.queued,
            );
            if tick.cause == Cause::Pressure {
                why.push_str(" (on the server's queued-calls signal)");
            }
            if want < step {
                why.push_str(&format!(
                    ", clipped to {want}: idle beyond reserve elsewhere {elsewhere} vs {}x demand {demand}",
                    cfg.idle_elsewhere_factor
                ));
            }
            requests.push(OpenRequest {
                server_id: s.view.server_id.clone(),
                budgeted: None,
                direct,
                kind: ActionKind::Grow,
                want,
                why,
            });
        }
        requests
    }
}

impl Planner {
    /// No server to call home (none known, or only draining ones): open the reserve.
    pub(super) fn bootstrap(&self, tick: &Tick) -> Option<OpenRequest> {
        if tick.servers.iter().any(|s| s.state != State::Evacuated) {
            return None;
        }
        Some(OpenRequest {
            server_id: ANY_SERVER.to_string(),
            budgeted: None,
            direct: None,
            kind: ActionKind::Fill,
            want: self.cfg.reserve,
            why: format!(
                "no server holds live streams outside evacuation ({} known); reserve {}",
                tick.servers.len(),
                self.cfg.reserve
            ),
        })
    }

    /// Sum the requests: credit the streams already opening, in request order, then cap
    /// live + opening + stalled + new at `max_streams` (the streams this plan closes no
    /// longer count). Stalled opens are not credited (`Snapshot::stalled`).
    /// At the cap, a tick makes room for a short server by recycling idle streams of the
    /// best-covered ones (see [`Planner::make_room`]).
    pub(super) fn open(&mut self, tick: &Tick, requests: Vec<OpenRequest>, plan: &mut Plan) {
        let mut credit = tick.opening;
        let direct_opening: u32 = tick
            .servers
            .iter()
            .fold(0, |n, s| n.saturating_add(s.view.opening));
        let live_after = tick.live().saturating_sub(count(plan.close.len()));
        let have = live_after
            .saturating_add(tick.opening)
            .saturating_add(tick.stalled)
            .saturating_add(direct_opening);
        let mut room = self.cfg.max_streams.saturating_sub(have);
        // Room is recycled on ticks, and only at the cap: over it (a lowered cap) the
        // retirement gets under it first.
        let mut recyclable = if tick.cause == Cause::Tick && have <= self.cfg.max_streams {
            self.cfg.grow_min
        } else {
            0
        };
        let budget = self.fill_budget(tick.servers.len());
        for r in requests {
            let credited = match &r.direct {
                Some((_, _, opening)) => (*opening).min(r.want),
                None => {
                    let c = credit.min(r.want);
                    credit -= c;
                    c
                }
            };
            let asked = r.want - credited;
            let mut n = asked.min(room);
            room -= n;
            let mut reason = r.why;
            if credited > 0 {
                reason.push_str(&format!(", {credited} already opening"));
            }
            if n < asked {
                // At max_streams: room for a short server comes from the best-covered ones,
                // at most grow_min a tick and within the short server's fill budget.
                let fill_left = match &r.budgeted {
                    Some(k) => budget
                        .saturating_sub(self.memory.get(k).map_or(0, |m| m.fill_opens))
                        .max(1),
                    None => u32::MAX,
                };
                let want = (asked - n).min(recyclable).min(fill_left);
                let made = self.make_room(tick, want, &r.server_id, plan);
                recyclable -= made;
                n += made;
                if n < asked {
                    reason.push_str(&format!(", capped by max_streams {}", self.cfg.max_streams));
                }
                if made > 0 {
                    reason.push_str(&format!(
                        ", {made} in room recycled from the best-covered servers"
                    ));
                }
            }
            if n == 0 {
                continue;
            }
            if let Some(k) = &r.budgeted {
                let mem = self.memory.entry(k.clone()).or_default();
                mem.fill_opens = mem.fill_opens.saturating_add(n);
                if mem.fill_opens >= budget {
                    // Spent (or a paced open): the next one waits `fill_retry`.
                    mem.paced_at = Some(tick.now);
                }
            }
            // Opens that bypass the load balancer (and its backoff gate).
            let direct = r.direct.as_ref().is_some_and(|(_, url, _)| !url.is_empty());
            match r.direct {
                Some(((server_id, instance_id), url, _)) => {
                    if url.is_empty() {
                        reason.push_str(&format!(
                            "; opening {n} through the load balancer naming {server_id}"
                        ));
                    } else {
                        reason.push_str(&format!("; opening {n} direct to {url}"));
                    }
                    plan.direct.push(DirectOpen {
                        server_id,
                        instance_id,
                        url,
                        count: n,
                        fill: r.kind == ActionKind::Fill,
                    });
                }
                None => {
                    reason.push_str(&format!("; opening {n}"));
                    plan.open += n;
                    if r.kind == ActionKind::Fill {
                        plan.probes += n;
                    }
                }
            }
            plan.actions.push(Action {
                server_id: r.server_id,
                kind: r.kind,
                count: n,
                direct,
                reason,
            });
        }
    }

    /// Closes up to `want` idle streams of covered servers beyond their busy + reserve, from
    /// the best-covered one down, so `for_server` can have the room at `max_streams`.
    /// Returns how many it closed.
    pub(super) fn make_room(
        &self,
        tick: &Tick,
        want: u32,
        for_server: &str,
        plan: &mut Plan,
    ) -> u32 {
        if want == 0 {
            return 0;
        }
        let reserve = self.cfg.reserve;
        let closing: HashSet<StreamId> = plan.close.iter().copied().collect();
        let mut donors: Vec<(&Server, Vec<StreamId>)> = tick
            .servers
            .iter()
            .filter(|s| s.state == State::Covered && s.view.server_id != for_server)
            .map(|s| {
                let spare = s.live.saturating_sub(s.budget(reserve)) as usize;
                let idle: Vec<StreamId> = s
                    .idle_streams()
                    .into_iter()
                    .map(|st| st.id)
                    .filter(|id| !closing.contains(id))
                    .take(spare)
                    .collect();
                (s, idle)
            })
            .filter(|(_, idle)| !idle.is_empty())
            .collect();
        donors.sort_by(|a, b| {
            b.1.len()
                .cmp(&a.1.len())
                .then_with(|| a.0.view.server_id.cmp(&b.0.view.server_id))
        });
        let mut made = 0u32;
        for (s, idle) in donors {
            if made >= want {
                break;
            }
            let take = ((want - made) as usize).min(idle.len());
            made += count(take);
            let reason = format!(
                "max_streams {} reached and {for_server} is short: closing {take} of {} idle streams beyond busy {} + reserve {reserve} to open there instead",
                self.cfg.max_streams,
                idle.len(),
                s.busy()
            );
            plan.close_on(
                &s.view.server_id,
                ActionKind::Recycle,
                idle[..take].iter().copied(),
                reason,
            );
        }
        made
    }
}
