//! The admin HTTP listener every binary runs: `GET /metrics` (Prometheus text from the
//! binary's own registry, and the runtime's worker threads), `GET /healthz` (the process
//! is up), `GET /readyz` (the binary's readiness check) and any extra routes the binary
//! adds (the agent's `/systemcheck`, the dispatcher's `/debug/routes`, the tunnel
//! server's `/debug/tunnels`, and each one's status page at `/`, see `crate::html`).
//!
//! It owns no product state: every answer comes from closures the binary supplies.
//! It accepts through `listen::incoming` with [`ListenerLimits::admin`]: a cap on
//! connections, the first-byte bound, and idle connections closed.

use crate::listen::{self, HeldBody, ListenerGuard, ListenerLimits, ListenerMetrics};
use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub type AdminResponse = Response<Full<Bytes>>;

/// A readiness check: `(ready, json detail)`.
pub type ReadyFn = Arc<dyn Fn() -> (bool, serde_json::Value) + Send + Sync>;
/// Extra routes: given the path of a GET, an answer or `None` for 404.
pub type RouteFn = Arc<dyn Fn(&str) -> Option<AdminResponse> + Send + Sync>;

#[derive(Clone)]
pub struct Admin {
    /// The binary's metric registry, rendered on `/metrics`.
    pub registry: prometheus::Registry,
    /// What `/readyz` answers.
    pub ready: ReadyFn,
    /// Binary-specific routes, consulted before the 404.
    pub routes: Option<RouteFn>,
    /// The process's listener counters (the `admin` listener's series go there); unset,
    /// `serve` registers them in `registry`.
    pub listener_metrics: Option<ListenerMetrics>,
    /// The listener's limits ([`ListenerLimits::admin`]).
    pub limits: ListenerLimits,
}

impl Admin {
    pub fn new(registry: prometheus::Registry) -> Self {
        Admin {
            registry,
            ready: Arc::new(|| (true, serde_json::json!({}))),
            routes: None,
            listener_metrics: None,
            limits: ListenerLimits::admin(),
        }
    }

    /// Counts the admin listener's refusals in these (already registered) counters.
    pub fn with_listener_metrics(mut self, metrics: ListenerMetrics) -> Self {
        self.listener_metrics = Some(metrics);
        self
    }

    pub fn with_ready(
        mut self,
        f: impl Fn() -> (bool, serde_json::Value) + Send + Sync + 'static,
    ) -> Self {
        self.ready = Arc::new(f);
        self
    }

    pub fn with_routes(
        mut self,
        f: impl Fn(&str) -> Option<AdminResponse> + Send + Sync + 'static,
    ) -> Self {
        self.routes = Some(Arc::new(f));
        self
    }

    fn answer(&self, req: &Request<Incoming>) -> AdminResponse {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return json(
                StatusCode::METHOD_NOT_ALLOWED,
                &serde_json::json!({"error": "method not allowed"}),
            );
        }
        match req.uri().path() {
            "/metrics" => {
                let mut text = render_metrics(&self.registry);
                text.push_str(&runtime_metrics());
                Response::builder()
                    .header("content-type", "text/plain; version=0.0.4")
                    .body(Full::new(Bytes::from(text)))
                    .expect("static response")
            }
            "/healthz" => json(StatusCode::OK, &serde_json::json!({"ok": true})),
            "/readyz" => {
                let (ok, detail) = (self.ready)();
                let status = if ok {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                json(status, &serde_json::json!({"ok": ok, "detail": detail}))
            }
            path => self
                .routes
                .as_ref()
                .and_then(|r| r(path))
                .unwrap_or_else(|| {
                    json(
                        StatusCode::NOT_FOUND,
                        &serde_json::json!({"error": "not found"}),
                    )
                }),
        }
    }
}

/// A JSON response with the given status.
pub fn json(status: StatusCode, value: &serde_json::Value) -> AdminResponse {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(value.to_string())))
        .expect("static response")
}

pub fn render_metrics(registry: &prometheus::Registry) -> String {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&registry.gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}

/// The process's runtime, appended to every binary's `/metrics`: its worker threads (the
/// config's `worker_threads`, see `crate::runtime`).
fn runtime_metrics() -> String {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return String::new();
    };
    format!(
        "# HELP relay_runtime_worker_threads Worker threads of the process's runtime (worker_threads).\n\
         # TYPE relay_runtime_worker_threads gauge\n\
         relay_runtime_worker_threads {}\n",
        handle.metrics().num_workers()
    )
}

/// Serves the admin routes on `listener` until `shutdown` resolves.
pub async fn serve(listener: TcpListener, admin: Admin, shutdown: impl Future<Output = ()>) {
    let metrics = match admin.listener_metrics.clone() {
        Some(m) => Some(m),
        None => ListenerMetrics::register(&admin.registry)
            .or_else(|_| ListenerMetrics::detached())
            .ok(),
    };
    let Some(metrics) = metrics else {
        tracing::warn!("admin listener: cannot build its counters; not serving");
        return;
    };
    let guard = ListenerGuard::new("admin", admin.limits.clone(), metrics);
    let admin = Arc::new(admin);
    let tracker = TaskTracker::new();
    let stop = CancellationToken::new();
    let mut incoming = Box::pin(listen::incoming(listener, None, guard, stop.clone()));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            _ = &mut shutdown => break,
            accepted = incoming.next() => {
                let stream = match accepted {
                    Some(Ok(s)) => s,
                    Some(Err(_)) => continue,
                    None => break,
                };
                let admin = admin.clone();
                let info = stream.info().clone();
                let idle = info.idle_notice();
                tracker.spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let held = info.hold();
                        let resp = admin.answer(&req).map(|b| HeldBody::new(b, Some(held)));
                        async move { Ok::<_, std::convert::Infallible>(resp) }
                    });
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    tokio::pin!(conn);
                    tokio::select! {
                        _ = conn.as_mut() => return,
                        _ = idle => {}
                    }
                    // Idle for its idle_timeout: close it the way HTTP allows.
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                });
            }
        }
    }
    stop.cancel();
    tracker.close();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// One keep-alive `GET /healthz`; whether it was answered 200.
    async fn healthz(s: &mut TcpStream) -> bool {
        if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n")
            .await
            .is_err()
        {
            return false;
        }
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
                _ => return false,
            }
            let text = String::from_utf8_lossy(&got);
            if text.ends_with("{\"ok\":true}") {
                return text.starts_with("HTTP/1.1 200");
            }
        }
    }

    async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(within, s.read(&mut buf)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    #[tokio::test]
    async fn the_admin_listener_caps_connections_and_closes_idle_ones() {
        let idle = Duration::from_millis(300);
        let registry = prometheus::Registry::new();
        let mut admin = Admin::new(registry.clone());
        admin.limits = ListenerLimits {
            max_connections: 2,
            idle_timeout: idle,
            ..ListenerLimits::admin()
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(listener, admin, stop.clone().cancelled_owned()));
        let mut a = TcpStream::connect(addr).await.unwrap();
        let mut b = TcpStream::connect(addr).await.unwrap();
        assert!(healthz(&mut a).await && healthz(&mut b).await);
        let mut c = TcpStream::connect(addr).await.unwrap();
        assert!(closed_within(&mut c, Duration::from_secs(5)).await);
        // Both keep-alive connections are closed once idle, which frees their places.
        assert!(
            closed_within(
                &mut a,
                idle + crate::listen::IDLE_GRACE + Duration::from_secs(5)
            )
            .await
        );
        assert!(closed_within(&mut b, Duration::from_secs(5)).await);
        let mut d = TcpStream::connect(addr).await.unwrap();
        assert!(healthz(&mut d).await);
        let text = render_metrics(&registry);
        assert!(
            text.contains(
                r#"relay_listener_refused_total{listener="admin",reason="max_connections"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"relay_listener_refused_total{listener="admin",reason="idle_timeout"} 2"#
            ),
            "{text}"
        );
        stop.cancel();
        task.await.unwrap();
    }
}
