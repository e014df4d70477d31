//! The dispatcher library alone on loopback, for its own tests: a real `start` on fresh
//! ports, fake tunnel servers announced to it ([`crate::fake_server`]), and a hyper client
//! acting as the backend. This module must not decide what a test asserts.

use crate::eventually;
use crate::fake_server::{intro, load_frame, report_stream, up, Announcer};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use relay_dispatcher::{CallerConfig, Config, Listeners};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;

/// The error of the tests' request bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The tests' request body.
pub type TestBody = BoxBody<Bytes, BoxError>;

/// The caller key the dispatcher accepts.
pub const KEY: &str = "test-caller-key";
/// How long a condition may take to come true.
pub const WAIT: Duration = Duration::from_secs(10);

/// A dispatcher run in process on loopback, with an HTTP client for its front.
pub struct Dispatcher {
    pub http: SocketAddr,
    pub registry: SocketAddr,
    pub admin: SocketAddr,
    pub handle: relay_dispatcher::DispatcherHandle,
    pub client: Client<HttpConnector, TestBody>,
}

/// A listener on a free loopback port.
pub async fn bind() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

/// A dispatcher with the tests' config: 5 s call timeout, one caller ([`KEY`]), leases
/// long enough for fake servers that announce once.
pub async fn start_dispatcher() -> Dispatcher {
    start_dispatcher_with(|_| {}).await
}

/// [`start_dispatcher`], with `tweak` applied to the config.
pub async fn start_dispatcher_with(tweak: impl FnOnce(&mut Config)) -> Dispatcher {
    let config = Config {
        call_timeout: Duration::from_secs(5),
        shutdown_grace: Duration::from_secs(2),
        callers: vec![CallerConfig::allow_all("ci", KEY)],
        // The fake servers announce once and never send load reports.
        registry: relay_dispatcher::RegistryConfig {
            lease: Duration::from_secs(600),
            refresh_interval: Duration::from_secs(1),
            ..Default::default()
        },
        ..Config::default().insecure()
    };
    let mut config = config;
    tweak(&mut config);
    let handle = relay_dispatcher::start(
        config,
        Listeners {
            http: bind().await,
            registry: bind().await,
            admin: bind().await,
        },
    )
    .await
    .expect("dispatcher starts");
    let client = Client::builder(TokioExecutor::new()).build_http();
    Dispatcher {
        http: handle.http_addr,
        registry: handle.registry_addr,
        admin: handle.admin_addr,
        handle,
        client,
    }
}

/// An empty request body.
pub fn empty() -> TestBody {
    Full::new(Bytes::new())
        .map_err(|never| match never {})
        .boxed()
}

/// A whole answer from the front.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Result<Bytes, String>,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(self.body.as_ref().expect("body")).expect("json body")
    }
}

impl Dispatcher {
    /// A request to the front, with the caller key `key` if any.
    pub fn request(&self, method: Method, path: &str, key: Option<&str>) -> http::request::Builder {
        let b = Request::builder()
            .method(method)
            .uri(format!("http://{}{}", self.http, path));
        match key {
            Some(k) => b.header("authorization", format!("Bearer {k}")),
            None => b,
        }
    }

    /// Sends `req` and reads the whole answer.
    pub async fn send(&self, req: Request<TestBody>) -> Answer {
        let resp = self.client.request(req).await.expect("response head");
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| format!("{e:?}"));
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// A GET with the caller key.
    pub async fn get(&self, path: &str) -> Answer {
        self.send(
            self.request(Method::GET, path, Some(KEY))
                .body(empty())
                .unwrap(),
        )
        .await
    }

    /// A POST of `body` with the caller key.
    pub async fn post(&self, path: &str, body: &'static [u8]) -> Answer {
        self.send(
            self.request(Method::POST, path, Some(KEY))
                .body(
                    Full::new(Bytes::from_static(body))
                        .map_err(|n| match n {})
                        .boxed(),
                )
                .unwrap(),
        )
        .await
    }

    /// The admin listener's body at `path`.
    pub async fn admin_get(&self, path: &str) -> String {
        let uri = format!("http://{}{}", self.admin, path);
        let resp = self.client.get(uri.parse().unwrap()).await.unwrap();
        String::from_utf8(
            resp.into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
        .unwrap()
    }

    /// The value of the first `/metrics` line starting with `line_prefix` (0 when none).
    pub async fn metric(&self, line_prefix: &str) -> f64 {
        let text = self.admin_get("/metrics").await;
        text.lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }

    /// Waits until `/debug/routes` lists `server_id` for `tunnel_id` (or not, when `present` is false).
    pub async fn wait_route(&self, tunnel_id: &str, server_id: &str, present: bool) {
        let what = format!("{server_id} listed for {tunnel_id}: {present}");
        eventually(&what, WAIT, || async {
            let routes: serde_json::Value =
                serde_json::from_str(&self.admin_get("/debug/routes").await).unwrap();
            let listed = routes["tunnels"].as_array().unwrap().iter().any(|t| {
                t["tunnel_id"] == tunnel_id
                    && t["servers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|s| s["server_id"] == server_id)
            });
            listed == present
        })
        .await;
    }

    /// Stops it (panics if it does not stop within 10 s).
    pub async fn shutdown(self) {
        tokio::time::timeout(Duration::from_secs(10), self.handle.shutdown())
            .await
            .expect("the dispatcher stops")
            .unwrap();
    }
}

/// Announces `server_id` serving `tunnel_id` at `forward_url` and waits until it is routable.
pub async fn announce(
    d: &Dispatcher,
    server_id: &str,
    forward_url: &str,
    tunnel_id: &str,
) -> Announcer {
    let a = report_stream(
        d.registry,
        vec![intro(server_id, forward_url), up(tunnel_id)],
    )
    .await;
    d.wait_route(tunnel_id, server_id, true).await;
    a
}

/// Announces `server_id` with load figures for `tunnel_id` and waits until it is routable.
pub async fn announce_with_load(
    d: &Dispatcher,
    server_id: &str,
    forward_url: &str,
    tunnel_id: &str,
    idle: u32,
) -> Announcer {
    let a = report_stream(
        d.registry,
        vec![
            intro(server_id, forward_url),
            up(tunnel_id),
            load_frame(tunnel_id, idle, 0, 0),
        ],
    )
    .await;
    d.wait_route(tunnel_id, server_id, true).await;
    a
}

/// The home server `/debug/routes` names for `tunnel_id` (empty when none).
pub async fn home_of(d: &Dispatcher, tunnel_id: &str) -> String {
    let routes: serde_json::Value =
        serde_json::from_str(&d.admin_get("/debug/routes").await).unwrap();
    routes["tunnels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tunnel_id"] == tunnel_id)
        .and_then(|t| t["home"].as_str())
        .unwrap_or_default()
        .to_string()
}
