//! The actor's reading of its streams' news (`CoverageActor::on_event`): landings, calls
//! started and ended, pressure hints, fleet news, draining, closes (a lost path marks its
//! server lost) and failed opens (the direct-open fallback, learnt caps, the backoff).

use super::*;

impl CoverageActor {
    pub(super) fn on_event(&mut self, id: StreamId, ev: StreamEvent, ticker: &mut Interval) {
        let now = Instant::now();
        match ev {
            StreamEvent::Landed(l) => {
                let Some(op) = self.opening.remove(&id) else {
                    return;
                };
                self.backoff.reset();
                debug!(stream = id, server_id = %l.server_id, instance_id = %l.instance_id, zone = %l.zone, "tunnel stream landed");
                let server = (l.server_id, l.instance_id);
                match &op.direct {
                    None => self.placements.land(&server),
                    Some(wanted) if op.steered && wanted.0 != server.0 => {
                        // The load balancer placed an open naming a server as any other:
                        // it does not route by the name, or that server is down there.
                        // Balanced opens for that server for a while; the stream stays
                        // where it landed (a fill open goes back as any probe does).
                        self.placements.land(&server);
                        if self.direct_failed.insert(wanted.clone(), now).is_none() {
                            if self.lost.contains_key(wanted) {
                                debug!(server_id = %wanted.0, landed_on = %server.0, "an open naming a lost tunnel server landed on another");
                            } else {
                                warn!(server_id = %wanted.0, instance_id = %wanted.1, landed_on = %server.0, "an open naming a tunnel server landed on another: the load balancer does not route by {} (or the server is down there); opening through it unnamed for {}s", relay_proto::AGENT_STEER, DIRECT_RETRY.as_secs());
                            }
                        }
                    }
                    Some(_) => {}
                }
                // Its own loss, or that of the instances of its server id it replaced
                // (they left the fleet: the server restarted).
                let fleet = &self.fleet;
                let mut since = self.lost.remove(&server);
                self.lost.retain(|k, at| {
                    let replaced = k.0 == server.0
                        && !fleet
                            .iter()
                            .any(|m| m.server_id == k.0 && m.instance_id == k.1);
                    if replaced {
                        since = since.max(Some(*at));
                    }
                    !replaced
                });
                if let Some(since) = since {
                    info!(server_id = %server.0, instance_id = %server.1, lost_ms = now.saturating_duration_since(since).as_millis() as u64, "tunnel server answers again; filling it back");
                }
                let info = self.servers.entry(server.clone()).or_default();
                info.direct_url = l.direct_url;
                let mut entry = Entry {
                    server,
                    load: info.load.clone(),
                    zone: l.zone,
                    busy: false,
                    opened_at: now,
                    last_used: now,
                    retiring: false,
                    retire: op.retire,
                    probe: op.probe,
                };
                if self.shutting_down {
                    retire(&mut entry);
                }
                let first = !self.streams.values().any(|e| !e.retiring);
                self.streams.insert(id, entry);
                if first && !self.shutting_down {
                    // The first live stream: calls can reach the agent now, so /systemcheck
                    // and /readyz say so at once rather than up to a tick later. An extra
                    // tick, outside the cadence (which stays as it was).
                    self.plan_now(Cause::Tick);
                }
            }
            StreamEvent::CallStarted => {
                if let Some(e) = self.streams.get_mut(&id) {
                    e.probe = false;
                    if !e.busy {
                        e.busy = true;
                        e.load.started();
                    }
                    // A call took a stream while calls queue there: the server has no idle
                    // stream left, and what opens to it may not be enough. The call is one
                    // of the queued ones (a server queues calls only while it has no idle
                    // stream), so the hint counts one less until the next one corrects it:
                    // streams landing between two hints are not counted twice (busy, and
                    // still queued).
                    if let Some(info) = self.servers.get_mut(&e.server) {
                        if info.fresh_queued(now) > 0 {
                            info.queued -= 1;
                            self.growth_due = true;
                        }
                    }
                }
            }
            StreamEvent::CallEnded(took) => {
                if let Some(e) = self.streams.get_mut(&id) {
                    if e.busy {
                        e.load.ended();
                        if let (Some(info), Some(took)) = (self.servers.get_mut(&e.server), took) {
                            info.call_time.observe_duration(took);
                        }
                    }
                    e.busy = false;
                    e.last_used = now;
                }
            }
            StreamEvent::Pressure(queued) => {
                if let Some(e) = self.streams.get(&id) {
                    let info = self.servers.entry(e.server.clone()).or_default();
                    if queued > info.fresh_queued(now) {
                        // The queue grew: grow now, not at the next tick.
                        self.growth_due = true;
                    }
                    info.queued = queued;
                    info.queued_at = Some(now);
                }
            }
            StreamEvent::Fleet(members) => {
                if members != self.fleet {
                    debug!(members = members.len(), "fleet news");
                    let joined = members.iter().any(|m| {
                        !self
                            .fleet
                            .iter()
                            .any(|o| o.server_id == m.server_id && o.instance_id == m.instance_id)
                    });
                    self.fleet = members;
                    if joined {
                        // A server to cover that we did not know: fill it soon, not a tick later.
                        self.replan_soon(now, ticker);
                    }
                }
            }
            StreamEvent::Drained => {
                if let Some(e) = self.streams.get_mut(&id) {
                    // The stream keeps serving; the plan recycles it once another server
                    // is covered (make before break).
                    let server = self.servers.entry(e.server.clone()).or_default();
                    if !server.draining {
                        info!(server_id = %e.server.0, instance_id = %e.server.1, "tunnel server is draining");
                    }
                    server.draining = true;
                }
            }
            StreamEvent::Closed(reason) => {
                self.opening.remove(&id);
                if let Some(e) = self.streams.get(&id) {
                    debug!(stream = id, server_id = %e.server.0, %reason, "tunnel stream closed");
                    let server = e.server.clone();
                    self.remove_stream(id);
                    // The last stream there went with its path: the server is lost until
                    // a stream lands there again.
                    let path_lost = matches!(
                        reason,
                        CloseReason::Silent
                            | CloseReason::HeartbeatMissed
                            | CloseReason::Lost
                            | CloseReason::Status(_)
                    );
                    if path_lost
                        && !self.servers.contains_key(&server)
                        && !self.lost.contains_key(&server)
                    {
                        warn!(server_id = %server.0, instance_id = %server.1, %reason, "tunnel server lost: its path went silent or broke; reconnecting");
                        self.lost.insert(server, now);
                    }
                }
                self.replan_soon(now, ticker);
            }
            StreamEvent::Stalled => {
                if let Some(op) = self.opening.get_mut(&id) {
                    op.stalled = true;
                    debug!(
                        stream = id,
                        waited_ms = now.saturating_duration_since(op.started).as_millis() as u64,
                        "tunnel stream open stalled: presumed lost, no longer credited"
                    );
                    // The growth it was credited against may be short again.
                    self.growth_due = true;
                }
            }
            StreamEvent::OpenFailed(err) => {
                let Some(op) = self.opening.remove(&id) else {
                    return;
                };
                let direct_url = op.direct.as_ref().filter(|_| !op.steered);
                if let (Some(key), false) = (direct_url, matches!(err, OpenError::Exhausted(..))) {
                    // The direct path failed: the load balancer takes over for a while;
                    // not a reason to back off opens through it. (A steered open failed on
                    // the load balancer's path, and counts as any open through it.)
                    if self.direct_failed.insert(key.clone(), now).is_none() {
                        warn!(server_id = %key.0, error = %err, "direct open failed; growing through the load balancer for {}s", DIRECT_RETRY.as_secs());
                    }
                    return;
                }
                match &err {
                    OpenError::Exhausted(_, refused) => {
                        debug!(stream = id, error = %err, "stream landed on a server at its cap; will open again");
                        // Learn the cap, so the plan stops asking that server for more.
                        if let Some(r) = refused {
                            if let Some(cap) = r.cap {
                                let key = (r.server_id.clone(), r.instance_id.clone());
                                if self.caps.insert(key, cap) != Some(cap) {
                                    info!(server_id = %r.server_id, instance_id = %r.instance_id, cap, "tunnel server refuses streams over its per-token cap; growth there stops at it");
                                }
                            }
                        }
                    }
                    OpenError::Unauthenticated(_) | OpenError::Other(_) => {
                        self.backoff.failed(now, op.started, &err)
                    }
                    // The dialer paused that endpoint; the next opens go through the others.
                    OpenError::Endpoint(_) => {
                        debug!(stream = id, error = %err, "open through a paused endpoint failed");
                    }
                    // The servers are busy, the path is alive: the open window narrowed
                    // (`crate::stream::window`), and the plan asks again at its pace.
                    OpenError::Busy(_) => {
                        debug!(stream = id, error = %err, "open timed out on a busy connection");
                    }
                }
            }
        }
    }
}
