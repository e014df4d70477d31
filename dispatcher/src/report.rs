//! The `Registry.Report` gRPC service: each tunnel server keeps one client stream open and
//! tells the dispatcher which tunnel ids it holds streams for, plus periodic load figures.
//!
//! It owns the translation from report frames to [`Routes`] updates and the lifetime of
//! a server's local entries (they live as long as its report stream, and no longer than the
//! lease past its last frame). It must not route calls or talk to tunnel servers.
//!
//! Admission: with `[registry] server_key` set, a stream must carry
//! `authorization: Bearer <key>` (compared in constant time) or it is refused with
//! UNAUTHENTICATED; with `allowed_servers` set, an intro naming another server id is refused
//! with PERMISSION_DENIED, as is, with `server_id_in_cert`, an intro naming a server id
//! its client certificate does not name. Every refusal is logged with the peer address and counted; the
//! key is never logged.

use crate::metrics::Metrics;
use crate::registry::{LoadFigures, Routes, ServerInfo, SessionId, TunnelFigures};
use futures::StreamExt;
use relay_common::KeyDigest;
use relay_proto::server_report::Kind;
use relay_proto::{ReportAck, ServerReport};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{error, info, warn};

/// How long a new report stream may take to send its `ServerIntro`.
const INTRO_TIMEOUT: Duration = Duration::from_secs(10);

pub use relay_common::tunnel_id::is_valid as valid_tunnel_id;

/// The service tunnel servers report to.
pub struct ReportService {
    pub routes: Arc<Routes>,
    /// Shared secret tunnel servers must present; `None` admits any.
    pub server_key: Option<KeyDigest>,
    /// Server ids allowed to report; empty admits any.
    pub allowed_servers: Vec<String>,
    /// `[registry] server_id_in_cert`: the intro's server id must be named by the
    /// stream's client certificate.
    pub server_id_in_cert: bool,
    pub metrics: Metrics,
    /// Cancelled at shutdown: open report streams end with UNAVAILABLE.
    pub stop: CancellationToken,
}

/// Forgets the server when the report handler ends, however it ends (the registry logs
/// the departure and drops what only the server used).
struct SessionGuard<'a> {
    routes: &'a Routes,
    session: SessionId,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        self.routes.leave(self.session);
    }
}

impl ReportService {
    fn refuse(peer: &str, why: String) -> Status {
        warn!(%peer, reason = %why, "report stream refused");
        Status::invalid_argument(why)
    }

    /// Checks the stream's bearer key when one is configured.
    fn authenticate(
        &self,
        peer: &str,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<(), Status> {
        let Some(key) = &self.server_key else {
            return Ok(());
        };
        let presented = metadata
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match presented {
            Some(p) if key.matches(p.as_bytes()) => Ok(()),
            _ => {
                let why = if presented.is_some() {
                    "wrong tunnel server key"
                } else {
                    "missing tunnel server key: send authorization: Bearer <registry.server_key>"
                };
                self.metrics
                    .reports_refused
                    .with_label_values(&["unauthenticated"])
                    .inc();
                warn!(%peer, reason = why, "report stream refused");
                Err(Status::unauthenticated(why))
            }
        }
    }

    fn intro(
        peer: &str,
        frame: Result<Option<ServerReport>, Status>,
    ) -> Result<ServerInfo, Status> {
        let intro = match frame {
            Ok(Some(ServerReport {
                kind: Some(Kind::Intro(intro)),
            })) => intro,
            Ok(Some(_)) => {
                return Err(Self::refuse(
                    peer,
                    "the first report frame must be a ServerIntro".into(),
                ))
            }
            Ok(None) => {
                return Err(Self::refuse(
                    peer,
                    "report stream ended before its ServerIntro".into(),
                ))
            }
            Err(status) => {
                return Err(Self::refuse(
                    peer,
                    format!("bad report stream: {}", status.message()),
                ))
            }
        };
        if intro.protocol_version != relay_proto::PROTOCOL_VERSION {
            let why = format!(
                "protocol version {} is not supported (this dispatcher speaks {})",
                intro.protocol_version,
                relay_proto::PROTOCOL_VERSION
            );
            warn!(%peer, server_id = ?intro.server_id, reason = %why, "report stream refused");
            return Err(Status::failed_precondition(why));
        }
        // Checked before anything of the intro is logged: ids that pass are printable.
        if !relay_common::server_id::is_valid(&intro.server_id) {
            return Err(Self::refuse(
                peer,
                format!(
                    "ServerIntro.server_id must be {}",
                    relay_common::server_id::RULE
                ),
            ));
        }
        for (field, value) in [("zone", &intro.zone), ("instance_id", &intro.instance_id)] {
            if !value.is_empty() && !relay_common::server_id::is_valid(value) {
                return Err(Self::refuse(
                    peer,
                    format!(
                        "ServerIntro.{field} must be empty or {}",
                        relay_common::server_id::RULE
                    ),
                ));
            }
        }
        let url_ok = intro
            .forward_url
            .parse::<http::Uri>()
            .ok()
            .is_some_and(|u| {
                matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some()
            });
        if !url_ok {
            return Err(Self::refuse(
                peer,
                format!(
                    "ServerIntro.forward_url {:?} is not an http(s) URL",
                    intro.forward_url
                ),
            ));
        }
        let direct_ok = intro.direct_url.is_empty()
            || (intro.direct_url.len() <= 2048
                && intro.direct_url.parse::<http::Uri>().ok().is_some_and(|u| {
                    matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some()
                }));
        if !direct_ok {
            return Err(Self::refuse(
                peer,
                "ServerIntro.direct_url is not an http(s) URL with a host".into(),
            ));
        }
        Ok(ServerInfo {
            server_id: intro.server_id,
            zone: intro.zone,
            forward_url: intro.forward_url,
            instance_id: intro.instance_id,
            direct_url: intro.direct_url,
        })
    }

    /// Applies one frame after the intro; an error ends the stream with that status.
    fn apply(
        &self,
        peer: &str,
        session: SessionId,
        server_id: &str,
        frame: ServerReport,
    ) -> Result<bool, Status> {
        let current = match frame.kind {
            Some(Kind::TunnelUp(up)) => {
                if !valid_tunnel_id(&up.tunnel_id) {
                    return Err(Self::refuse(
                        peer,
                        format!("TunnelUp: invalid tunnel id {:?}", up.tunnel_id),
                    ));
                }
                let ok = self.routes.tunnel_up(session, &up.tunnel_id);
                if ok {
                    info!(%server_id, tunnel_id = %up.tunnel_id, "tunnel up");
                }
                ok
            }
            Some(Kind::TunnelDown(down)) => {
                if !valid_tunnel_id(&down.tunnel_id) {
                    return Err(Self::refuse(
                        peer,
                        format!("TunnelDown: invalid tunnel id {:?}", down.tunnel_id),
                    ));
                }
                let ok = self.routes.tunnel_down(session, &down.tunnel_id);
                if ok {
                    info!(%server_id, tunnel_id = %down.tunnel_id, "tunnel down");
                }
                ok
            }
            Some(Kind::Load(load)) => {
                let partial = load.partial;
                self.metrics
                    .load_reports
                    .with_label_values(&[if partial { "partial" } else { "whole" }])
                    .inc();
                self.metrics
                    .load_report_tunnels
                    .inc_by(load.tunnels.len() as u64);
                let figures = LoadFigures {
                    tunnels: load
                        .tunnels
                        .into_iter()
                        .filter(|t| valid_tunnel_id(&t.tunnel_id))
                        .map(|t| {
                            let f = TunnelFigures {
                                idle: t.idle,
                                busy: t.busy,
                                queued: t.queued,
                                rtt_us: t.rtt_us,
                            };
                            (t.tunnel_id, f)
                        })
                        .collect(),
                    calls_in_flight: load.calls_in_flight,
                    draining: load.draining,
                    cpu_permille: load.cpu_permille.min(1000),
                };
                self.routes.load(session, figures, partial)
            }
            Some(Kind::Intro(_)) => {
                return Err(Self::refuse(
                    peer,
                    "a second ServerIntro on one report stream".into(),
                ))
            }
            None => return Err(Self::refuse(peer, "report frame without a kind".into())),
        };
        Ok(current)
    }
}

type FleetStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<relay_proto::Fleet, Status>> + Send>>;

#[tonic::async_trait]
impl relay_proto::registry_server::Registry for ReportService {
    type WatchStream = FleetStream;

    /// The fleet's members now, then on every change, until the dispatcher stops.
    async fn watch(
        &self,
        request: Request<relay_proto::WatchRequest>,
    ) -> Result<Response<FleetStream>, Status> {
        let peer = relay_common::listen::ConnInfo::peer(&request);
        self.authenticate(&peer, request.metadata())?;
        let stop = self.stop.clone();
        let fleet = tokio_stream::wrappers::WatchStream::new(self.routes.watch_fleet())
            .map(|members| Ok(relay_proto::Fleet { members }))
            .take_until(stop.cancelled_owned());
        let mut response = Response::new(Box::pin(fleet) as FleetStream);
        // What this dispatcher reads on the report stream beyond the first version.
        response.metadata_mut().insert(
            relay_proto::REGISTRY_FEATURES,
            tonic::metadata::MetadataValue::from_static(relay_proto::FEATURE_PARTIAL_LOAD),
        );
        Ok(response)
    }

    async fn report(
        &self,
        request: Request<Streaming<ServerReport>>,
    ) -> Result<Response<ReportAck>, Status> {
        let peer = relay_common::listen::ConnInfo::peer(&request);
        self.authenticate(&peer, request.metadata())?;
        let cert_names = relay_common::listen::ConnInfo::of(&request)
            .map(|c| c.peer_names.clone())
            .unwrap_or_else(|| Arc::from(Vec::new()));
        let mut stream = request.into_inner();
        let first = tokio::select! {
            biased;
            _ = self.stop.cancelled() => return Err(Status::unavailable("dispatcher shutting down")),
            first = tokio::time::timeout(INTRO_TIMEOUT, stream.message()) => match first {
                Ok(frame) => frame,
                Err(_) => return Err(Self::refuse(&peer, "no ServerIntro within 10s".into())),
            },
        };
        let info = Self::intro(&peer, first).inspect_err(|_| {
            self.metrics
                .reports_refused
                .with_label_values(&["bad_intro"])
                .inc();
        })?;
        let server_id = info.server_id.clone();
        if !self.allowed_servers.is_empty() && !self.allowed_servers.contains(&server_id) {
            self.metrics
                .reports_refused
                .with_label_values(&["unknown_server"])
                .inc();
            warn!(%peer, %server_id, "report stream refused: server id not in registry.allowed_servers");
            return Err(Status::permission_denied(format!(
                "tunnel server {server_id:?} is not allowed to report here"
            )));
        }
        if self.server_id_in_cert && !cert_names.contains(&server_id) {
            self.metrics
                .reports_refused
                .with_label_values(&["server_id_not_in_cert"])
                .inc();
            warn!(%peer, %server_id, names = ?cert_names, "report stream refused: the client certificate does not name this server id");
            return Err(Status::permission_denied(format!(
                "tunnel server {server_id:?} is not named by the client certificate it reports with"
            )));
        }
        let instance_id = info.instance_id.clone();
        let session = match self.routes.join(info.clone()) {
            Ok(session) => session,
            Err(conflict) => {
                self.metrics
                    .reports_refused
                    .with_label_values(&["duplicate_server_id"])
                    .inc();
                error!(%peer, %server_id, %instance_id, live_instance = %conflict.live_instance, "report stream refused: another live tunnel server reports with this server id; give each server its own server_id");
                return Err(Status::already_exists(format!(
                    "server id {server_id:?} is live here as instance {}; give each tunnel server its own server_id",
                    conflict.live_instance
                )));
            }
        };
        info!(%peer, %server_id, %instance_id, zone = %info.zone, forward_url = %info.forward_url, "tunnel server joined");
        let _guard = SessionGuard {
            routes: &self.routes,
            session,
        };
        let mut last_frame = tokio::time::Instant::now();
        loop {
            // Shutdown first: a server flooding reports must not keep the dispatcher up.
            let frame = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return Err(Status::unavailable("dispatcher shutting down")),
                frame = stream.message() => frame,
            };
            match frame {
                Ok(Some(frame)) => {
                    let now = tokio::time::Instant::now();
                    self.metrics
                        .report_gap
                        .observe(now.duration_since(last_frame).as_secs_f64());
                    last_frame = now;
                    if !self.apply(&peer, session, &server_id, frame)? {
                        info!(%server_id, "report stream superseded by a newer one from the same server, or its lease expired");
                        return Err(Status::aborted(
                            "superseded by a newer report stream from this server, or the lease expired",
                        ));
                    }
                }
                Ok(None) => return Ok(Response::new(ReportAck {})),
                Err(status) => {
                    // The guard removes the server; the peer sees the status if it is still there.
                    warn!(%peer, %server_id, error = %status.message(), "report stream failed");
                    return Err(Status::invalid_argument(format!(
                        "bad report stream: {}",
                        status.message()
                    )));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::ServerIntro;

    fn intro(server_id: &str, zone: &str, instance_id: &str) -> Result<ServerInfo, Status> {
        let intro = ServerIntro {
            server_id: server_id.into(),
            zone: zone.into(),
            forward_url: "http://10.0.0.1:8451".into(),
            protocol_version: relay_proto::PROTOCOL_VERSION,
            instance_id: instance_id.into(),
            direct_url: String::new(),
        };
        let frame = ServerReport {
            kind: Some(Kind::Intro(intro)),
        };
        ReportService::intro("test", Ok(Some(frame)))
    }

    #[test]
    fn an_intro_whose_names_would_forge_log_lines_is_refused_before_anything_is_logged() {
        let info = intro("ts-1", "eu-west", "00ff00ff00ff00ff").unwrap();
        assert_eq!((&*info.server_id, &*info.zone), ("ts-1", "eu-west"));
        intro("ts-1", "", "").unwrap();
        let cases = [
            (
                "ts-1\n2026-12-01T00:00:00Z INFO forged",
                "local",
                "1",
                "server_id",
            ),
            ("ts\u{1b}[2J", "local", "1", "server_id"),
            ("ts 1", "local", "1", "server_id"),
            ("", "local", "1", "server_id"),
            ("ts-1", "eu\rwest", "1", "zone"),
            ("ts-1", "local", "1\u{202e}", "instance_id"),
        ];
        for (server_id, zone, instance_id, field) in cases {
            let status = intro(server_id, zone, instance_id).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{server_id:?}");
            assert!(status.message().contains(field), "{}", status.message());
        }
    }
}
