//! A backend's HTTP client for tests and the fleet tool: calls the dispatcher's front
//! with a caller key and reads the answer, streaming or whole.

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use std::net::SocketAddr;

/// One answer, read whole.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

#[derive(Clone)]
pub struct Caller {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    key: Option<String>,
}

impl Caller {
    pub fn new(front: SocketAddr, key: Option<&str>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build(connector);
        Caller {
            client,
            base: format!("http://{front}"),
            key: key.map(str::to_string),
        }
    }

    /// The request to `path` (which starts with `/relay/...` or any other path).
    pub fn request(
        &self,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
    ) -> Request<Full<Bytes>> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{}", self.base, path));
        if let Some(k) = &self.key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        b.body(Full::new(body.into())).expect("valid request")
    }

    pub async fn send(
        &self,
        req: Request<Full<Bytes>>,
    ) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
        Ok(self.client.request(req).await?)
    }

    /// Sends and reads the whole answer.
    pub async fn call(&self, req: Request<Full<Bytes>>) -> anyhow::Result<Answer> {
        let resp = self.send(req).await?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Answer> {
        self.call(self.request(Method::GET, path, Bytes::new()))
            .await
    }
}

/// Runs `curl` (the command-line client a person or a script would use) with `args` plus
/// `-sS -i`, and reads its one answer: status, headers and body. Fails when curl itself
/// fails (no answer).
pub async fn curl(args: &[&str]) -> anyhow::Result<Answer> {
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "-i", "--max-time", "30"])
        .args(args)
        .kill_on_drop(true)
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "curl {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let raw = out.stdout;
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("curl printed no response head"))?;
    let head = std::str::from_utf8(&raw[..end])?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("no status in {status_line:?}"))?;
    let mut headers = HeaderMap::new();
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            headers.append(
                http::HeaderName::from_bytes(name.trim().as_bytes())?,
                http::HeaderValue::from_str(value.trim())?,
            );
        }
    }
    Ok(Answer {
        status: StatusCode::from_bytes(status.as_bytes())?,
        headers,
        body: Bytes::copy_from_slice(&raw[end + 4..]),
    })
}
