//! Fill, evacuation and recycling: opens toward the reserve of a short idle server within
//! its fill budget (`Planner::fill`), the overdue server's streams closed
//! (`Planner::evacuate`) and an evacuated or draining server's idle streams closed
//! (`Planner::recycle`).

use super::*;

impl Planner {
    /// Overdue: close all streams of the server short and idle the longest, while another
    /// server is covered, at most once per `evacuate_cooldown`.
    pub(super) fn evacuate(&mut self, tick: &Tick, plan: &mut Plan) {
        let cfg = &self.cfg;
        if let Some(last) = self.last_evacuation {
            if tick.now.saturating_duration_since(last) < cfg.evacuate_cooldown {
                return;
            }
        }
        let since = |s: &Server| {
            self.memory
                .get(&s.key())
                .and_then(|m| m.short_idle_since)
                .unwrap_or(tick.now)
        };
        let Some(target) = tick
            .servers
            .iter()
            .filter(|s| s.state == State::Overdue && s.busy() == 0 && !s.absent())
            .min_by_key(|s| (since(s), s.view.server_id.as_str()))
        else {
            return;
        };
        let Some(covered) = tick
            .servers
            .iter()
            .find(|s| s.state == State::Covered && s.key() != target.key())
        else {
            return;
        };
        let idle = target.idle_streams();
        let reason = format!(
            "overdue: streams {} < reserve {}, no calls for {}s; {} is covered; closing {} idle streams",
            target.live,
            cfg.reserve,
            tick.now.saturating_duration_since(since(target)).as_secs(),
            covered.view.server_id,
            idle.len(),
        );
        plan.close_on(
            &target.view.server_id,
            ActionKind::Evacuate,
            idle.iter().map(|st| st.id),
            reason,
        );
        let mem = self.memory.entry(target.key()).or_default();
        mem.evacuated_at = Some(tick.now);
        mem.short_idle_since = None;
        self.last_evacuation = Some(tick.now);
    }

    /// Evacuated (or draining): close the idle streams that are there; busy ones go on a
    /// later tick, once idle.
    pub(super) fn recycle(&self, tick: &Tick, plan: &mut Plan) {
        // Make before break: an evacuated or draining server keeps serving on the streams
        // it holds until another server is covered, so a tunnel id never drops out between
        // the evacuation and the replacements landing (an evacuated server that was the
        // home of last resort keeps its streams while a first growth stream lands
        // elsewhere).
        let covered_elsewhere = tick
            .servers
            .iter()
            .any(|o| o.state == State::Covered && !o.view.draining);
        if !covered_elsewhere {
            return;
        }
        for s in tick.servers.iter().filter(|s| s.state == State::Evacuated) {
            let idle = s.idle_streams();
            if idle.is_empty() {
                continue;
            }
            let why = if s.view.draining {
                "draining".to_string()
            } else {
                let at = self.memory.get(&s.key()).and_then(|m| m.evacuated_at);
                let ago = at.map_or(0, |at| tick.now.saturating_duration_since(at).as_secs());
                format!(
                    "evacuated {ago}s ago (avoided for {}s)",
                    self.cfg.evacuated_for.as_secs()
                )
            };
            let reason = format!(
                "{why}: closing {} idle streams, {} busy finish first",
                idle.len(),
                s.in_flight
            );
            plan.close_on(
                &s.view.server_id,
                ActionKind::Recycle,
                idle.iter().map(|st| st.id),
                reason,
            );
        }
    }
}

impl Planner {
    /// Returned probes: on a covered server with no calls, the fill opens that landed
    /// beyond its budget and have carried no call are closed, the newest first. (Evacuation
    /// and recycling close streams of overdue and evacuated servers only: none of these.)
    pub(super) fn give_back(&self, tick: &Tick, plan: &mut Plan) {
        let reserve = self.cfg.reserve;
        for s in tick
            .servers
            .iter()
            .filter(|s| s.state == State::Covered && s.busy() == 0)
        {
            let spare = s.live.saturating_sub(s.budget(reserve)) as usize;
            if spare == 0 {
                continue;
            }
            let mut probes: Vec<&StreamView> = s
                .view
                .streams
                .iter()
                .filter(|st| st.probe && !st.busy && !st.retiring)
                .collect();
            if probes.is_empty() {
                continue;
            }
            probes.sort_by_key(|st| std::cmp::Reverse((st.opened_at, st.id)));
            probes.truncate(spare);
            let reason = format!(
                "streams {} > reserve {reserve}, no calls: returning {} fill opens that landed here",
                s.live,
                probes.len()
            );
            plan.close_on(
                &s.view.server_id,
                ActionKind::Return,
                probes.iter().map(|st| st.id),
                reason,
            );
        }
    }

    /// Filling: open the shortfall divided by the placement share, toward the reserve,
    /// within the fill budget (`reserve` x servers x 2 opens since the server became short),
    /// then one open per `fill_retry` while it stays short. Direct opens land there and
    /// need no budget. Steered opens land there too, but go through the load balancer:
    /// they ask for the shortfall within the same budget and pace, so a storm of opens that
    /// time out is not asked again every tick.
    pub(super) fn fill(&mut self, tick: &Tick, grown: &[OpenRequest]) -> Vec<OpenRequest> {
        let reserve = self.cfg.reserve;
        let budget = self.fill_budget(tick.servers.len());
        let retry = self.cfg.fill_retry;
        let mut requests = Vec::new();
        // Load-balanced opens asked for so far in this plan (growth first): a share of them
        // lands on each server filled here, so it needs that much less. The server needing
        // the most opens goes first, so the others are served by what lands on them.
        let mut planned: u32 = grown
            .iter()
            .filter(|r| r.direct.is_none())
            .fold(0, |n, r| n.saturating_add(r.want));
        let mut filling: Vec<&Server> = tick
            .servers
            .iter()
            .filter(|s| s.state == State::Filling)
            .collect();
        filling.sort_by(|a, b| {
            let need = |s: &Server| f64::from(s.shortfall(reserve)) / s.share;
            need(b)
                .total_cmp(&need(a))
                .then_with(|| a.view.server_id.cmp(&b.view.server_id))
        });
        for s in filling {
            let shortfall = s.shortfall(reserve);
            let direct = self.direct_of(s);
            let held = if s.absent() {
                "listed in the fleet, holds none of our streams".to_string()
            } else {
                format!("streams {} < reserve {reserve}, no calls", s.live)
            };
            let steered = direct.as_ref().is_some_and(|(_, url, _)| url.is_empty());
            if direct.is_some() && !steered {
                requests.push(OpenRequest {
                    server_id: s.view.server_id.clone(),
                    budgeted: None,
                    direct,
                    kind: ActionKind::Fill,
                    want: shortfall,
                    why: format!("short {shortfall}: {held}"),
                });
                continue;
            }
            // Steered opens land on the server; balanced ones at its share, less what the
            // plan's other balanced opens land there.
            let (landing, opens) = if steered {
                (0, shortfall)
            } else {
                let landing = landing_of(planned, s.share);
                if landing >= shortfall {
                    continue;
                }
                (landing, opens_for(shortfall - landing, s.share))
            };
            let mem = self.memory.entry(s.key()).or_default();
            let left = budget.saturating_sub(mem.fill_opens);
            // A lost server is reconnected to at a quicker pace for a while.
            let retry = match s.view.lost_since {
                Some(at) if tick.now.saturating_duration_since(at) < self.cfg.reconnect_for => {
                    self.cfg.reconnect.min(retry)
                }
                _ => retry,
            };
            let (want, pace) = if left > 0 {
                (opens.min(left), String::new())
            } else if mem
                .paced_at
                .is_none_or(|at| tick.now.saturating_duration_since(at) >= retry)
            {
                (
                    1,
                    format!(", budget spent: one open per {}ms", retry.as_millis()),
                )
            } else {
                continue;
            };
            if steered {
                requests.push(OpenRequest {
                    server_id: s.view.server_id.clone(),
                    budgeted: Some(s.key()),
                    direct,
                    kind: ActionKind::Fill,
                    want,
                    why: format!(
                        "short {shortfall}: {held} (fill opens so far {}, budget {budget}{pace})",
                        mem.fill_opens
                    ),
                });
                continue;
            }
            planned = planned.saturating_add(want);
            let of_others = if landing > 0 {
                format!(", {landing} of the plan's other opens land there")
            } else {
                String::new()
            };
            requests.push(OpenRequest {
                server_id: s.view.server_id.clone(),
                budgeted: Some(s.key()),
                direct: None,
                kind: ActionKind::Fill,
                want,
                why: format!(
                    "short {shortfall}: {held}; placement share {:.2}{of_others}: {opens} opens (fill opens so far {}, budget {budget}{pace})",
                    s.share, mem.fill_opens
                ),
            });
        }
        requests
    }
}
