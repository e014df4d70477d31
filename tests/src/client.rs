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
