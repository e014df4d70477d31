//! The HTTP/1.1 client to the customer's upstream origin: keep-alive connections (`pool`),
//! request building (origin + path, Host, hop-by-hop headers stripped), streamed request
//! bodies from a bounded channel, the response head deadline and a re-chunking response
//! body reader.
//!
//! It knows nothing about tunnels, frames, call ids or accept filters: the caller
//! (`call.rs`) runs `filter::Policy::prepare` first, turns the result into an
//! `UpstreamRequest` and the answer back into frames. The target host is always the
//! configured origin: the URI's authority and `Host` come from config, never from the
//! request. The client never follows redirects (hyper does not): a 3xx goes back to the
//! caller as is, so a `Location` pointing elsewhere cannot make the agent reach that host.
//! The request body, whole (it came inside the request head) or streamed, is counted against
//! `limits.max_body_bytes`. A response hands its connection back to the pool when its body
//! has been read to the end (and the request body went out whole); a response dropped
//! before that closes its connection.

mod pool;

use crate::error::UpstreamError;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, StatusCode, Uri};
use http_body::{Body as _, Frame};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ReqBody = UnsyncBoxBody<Bytes, BoxError>;

/// One request for the upstream, already checked for shape but not yet for policy.
#[derive(Debug)]
pub struct UpstreamRequest {
    pub method: Method,
    /// Origin-form target; must start with '/'.
    pub path_and_query: String,
    /// Headers as the caller sent them; hop-by-hop ones and `Host` are replaced here.
    pub headers: HeaderMap,
    /// Where the request body comes from.
    pub body: RequestBody,
    /// Bound on the request body's bytes; past it the request is aborted and the call
    /// fails with `UpstreamError::BodyTooLarge`.
    pub body_limit: Option<u64>,
    /// Send `Connection: close` so the pooled connection is not reused after this call
    /// (a body the upstream may not have read, see `filter::Prepared::close_connection`).
    pub close_connection: bool,
}

/// An upstream request's body.
#[derive(Debug)]
pub enum RequestBody {
    /// No body.
    None,
    /// The whole body, known when the call began (it came inside the request head).
    Whole(Bytes),
    /// Chunks fed through a bounded channel; the body ends when the sender is dropped.
    Streamed(mpsc::Receiver<Bytes>),
}

/// The HTTP client to one origin. Cheap to clone.
#[derive(Clone)]
pub struct Upstream {
    inner: Arc<Inner>,
}

struct Inner {
    pool: pool::Pool,
    scheme: Scheme,
    authority: Authority,
    host: HeaderValue,
    limit: Option<Arc<Semaphore>>,
}

/// A response head plus its body, read in bounded chunks.
pub struct UpstreamResponse {
    pub status: StatusCode,
    /// Response headers with hop-by-hop ones removed.
    pub headers: HeaderMap,
    body: Incoming,
    pending: Bytes,
    /// The request body's progress (its limit hit, its end sent).
    sent: Arc<SentBody>,
    body_limit: Option<u64>,
    /// The connection, until it goes back to the pool (or closes with this response).
    conn: Option<SendRequest<ReqBody>>,
    /// Whether the connection may serve another call once this one ends.
    reusable: bool,
    pool: pool::Pool,
    _permit: Option<OwnedSemaphorePermit>,
}

/// What the upstream request's body reports back while hyper sends it.
#[derive(Default)]
struct SentBody {
    /// The body went past its limit (the request was aborted).
    limit_hit: AtomicBool,
    /// The body has been handed to the connection whole.
    ended: AtomicBool,
}

impl std::fmt::Debug for UpstreamResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamResponse")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// `origin` is `http://host:port` (validated by `Config::validate`).
    pub fn new(
        origin: &str,
        connect_timeout: Duration,
        max_connections: Option<usize>,
    ) -> Result<Self, relay_common::config::ConfigError> {
        let (scheme, authority) = crate::config::upstream_origin(origin)?;
        let host = HeaderValue::from_str(authority.as_str()).map_err(|_| {
            relay_common::config::ConfigError::invalid("upstream", "host is not a valid header")
        })?;
        let pool = pool::Pool::new(&authority, connect_timeout, max_connections);
        let limit = max_connections.map(|n| Arc::new(Semaphore::new(n)));
        Ok(Upstream {
            inner: Arc::new(Inner {
                pool,
                scheme,
                authority,
                host,
                limit,
            }),
        })
    }

    /// The origin, for reports (`http://host:port`).
    pub fn origin(&self) -> String {
        format!("{}://{}", self.inner.scheme, self.inner.authority)
    }

    /// Sends `req` and waits for the response head until `deadline`. The returned
    /// response holds the concurrency permit (if capped) until it is dropped.
    pub async fn send(
        &self,
        req: UpstreamRequest,
        deadline: Instant,
    ) -> Result<UpstreamResponse, UpstreamError> {
        let body_limit = req.body_limit;
        let reusable = !req.close_connection;
        let (request, sent) = self.build(req)?;
        let permit = match &self.inner.limit {
            None => None,
            Some(sem) => match tokio::time::timeout_at(deadline, sem.clone().acquire_owned()).await
            {
                Err(_) => return Err(UpstreamError::Timeout),
                Ok(Err(_)) => {
                    return Err(UpstreamError::Unreachable("upstream client closed".into()))
                }
                Ok(Ok(p)) => Some(p),
            },
        };
        let (response, conn) =
            match tokio::time::timeout_at(deadline, self.inner.pool.send(request)).await {
                Err(_) => return Err(UpstreamError::Timeout),
                Ok(Err(e)) => {
                    return Err(match body_limit {
                        Some(limit) if sent.limit_hit.load(Ordering::SeqCst) => {
                            UpstreamError::BodyTooLarge(limit)
                        }
                        _ => UpstreamError::Unreachable(error_chain(&e)),
                    })
                }
                Ok(Ok(r)) => r,
            };
        let (parts, body) = response.into_parts();
        let mut headers = parts.headers;
        strip_hop_by_hop(&mut headers);
        Ok(UpstreamResponse {
            status: parts.status,
            headers,
            body,
            pending: Bytes::new(),
            sent,
            body_limit,
            conn: Some(conn),
            reusable,
            pool: self.inner.pool.clone(),
            _permit: permit,
        })
    }

    /// One GET of `path` for the reachability check; any HTTP answer is `Ok`.
    pub async fn probe(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Result<(StatusCode, Duration), UpstreamError> {
        let started = Instant::now();
        let req = UpstreamRequest {
            method: Method::GET,
            path_and_query: path.to_string(),
            headers: HeaderMap::new(),
            body: RequestBody::None,
            body_limit: None,
            close_connection: false,
        };
        let (request, _) = self.build(req)?;
        // The probe's body is not read: its connection closes with the response.
        match tokio::time::timeout(timeout, self.inner.pool.send(request)).await {
            Err(_) => Err(UpstreamError::Timeout),
            Ok(Err(e)) => Err(UpstreamError::Unreachable(error_chain(&e))),
            Ok(Ok((r, _))) => Ok((r.status(), started.elapsed())),
        }
    }

    /// The hyper request for `req` (origin-form target: the pool dials the origin), plus
    /// what its body reports while it is sent.
    fn build(
        &self,
        req: UpstreamRequest,
    ) -> Result<(Request<ReqBody>, Arc<SentBody>), UpstreamError> {
        // `filter::Policy::prepare` refuses these first; this is the last line of defence.
        if !req.path_and_query.starts_with('/') || req.path_and_query.starts_with("//") {
            return Err(UpstreamError::BadRequest(
                "request target must start with a single '/'".into(),
            ));
        }
        let pq: PathAndQuery = req
            .path_and_query
            .parse()
            .map_err(|e| UpstreamError::BadRequest(format!("invalid request target: {e}")))?;
        let uri = Uri::from(pq);
        let sent = Arc::new(SentBody::default());
        let body: ReqBody = match req.body {
            RequestBody::None => {
                sent.ended.store(true, Ordering::Relaxed);
                Empty::new().map_err(|e| match e {}).boxed_unsync()
            }
            RequestBody::Whole(data) => {
                if let Some(limit) = req.body_limit.filter(|l| data.len() as u64 > *l) {
                    return Err(UpstreamError::BodyTooLarge(limit));
                }
                sent.ended.store(true, Ordering::Relaxed);
                Full::new(data).map_err(|e| match e {}).boxed_unsync()
            }
            RequestBody::Streamed(rx) => LimitedBody {
                rx,
                seen: 0,
                limit: req.body_limit,
                sent: sent.clone(),
                done: false,
            }
            .boxed_unsync(),
        };
        let mut headers = req.headers;
        strip_hop_by_hop(&mut headers);
        headers.insert(header::HOST, self.inner.host.clone());
        if req.close_connection {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        let mut request = Request::new(body);
        *request.method_mut() = req.method;
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        Ok((request, sent))
    }
}

#[cfg(test)]
impl Upstream {
    /// `build` for the property tests: (where the request goes: the URI's authority if it
    /// names one, else the origin the pool dials; Host header; has Transfer-Encoding).
    pub(crate) fn build_for_test(
        &self,
        req: UpstreamRequest,
    ) -> Result<(String, String, bool), UpstreamError> {
        let (r, _) = self.build(req)?;
        let authority = r
            .uri()
            .authority()
            .map(|a| a.to_string())
            .unwrap_or_else(|| self.inner.authority.to_string());
        let host = r
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default()
            .to_string();
        Ok((
            authority,
            host,
            r.headers().contains_key(header::TRANSFER_ENCODING),
        ))
    }
}

impl UpstreamResponse {
    /// True when the response has no body at all (known from its head).
    pub fn is_empty(&self) -> bool {
        self.body.is_end_stream()
    }

    /// The body's length when the head tells it exactly (Content-Length).
    pub fn exact_len(&self) -> Option<u64> {
        http_body::Body::size_hint(&self.body)
            .exact()
            .map(|n| n + self.pending.len() as u64)
    }

    /// The next piece of the body, at most `max` bytes, with `true` when it is known to be
    /// the last. `Ok(None)`: the body ended after a piece that was not marked last.
    pub async fn next_chunk(&mut self, max: usize) -> Result<Option<(Bytes, bool)>, UpstreamError> {
        let max = max.max(1);
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(max);
                let piece = self.pending.split_to(n);
                let last = self.pending.is_empty() && self.body.is_end_stream();
                return Ok(Some((piece, last)));
            }
            match self.body.frame().await {
                None => {
                    self.release(true);
                    return Ok(None);
                }
                Some(Err(e)) => {
                    return Err(match self.body_limit {
                        Some(limit) if self.sent.limit_hit.load(Ordering::SeqCst) => {
                            UpstreamError::BodyTooLarge(limit)
                        }
                        _ => UpstreamError::Aborted(error_chain(&e)),
                    })
                }
                Some(Ok(frame)) => {
                    // Trailers are not carried by the wire yet; skip them.
                    if let Ok(data) = frame.into_data() {
                        self.pending = data;
                    }
                    if self.body.is_end_stream() {
                        self.release(true);
                    }
                }
            }
        }
    }

    /// Gives the connection back to the pool if the exchange ended cleanly (`ended`: the
    /// response body has been read to its end), else lets it close.
    fn release(&mut self, ended: bool) {
        if let Some(conn) = self.conn.take() {
            if ended && self.reusable && self.sent.ended.load(Ordering::Relaxed) {
                self.pool.put(conn);
            }
        }
    }
}

impl Drop for UpstreamResponse {
    fn drop(&mut self) {
        // A body with nothing left to read (none at all, or read to its end) frees the
        // connection; one dropped halfway closes it.
        let ended = self.body.is_end_stream();
        self.release(ended);
    }
}

/// A request body fed from the stream's channel, counted against its limit.
struct LimitedBody {
    rx: mpsc::Receiver<Bytes>,
    seen: u64,
    limit: Option<u64>,
    sent: Arc<SentBody>,
    done: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("request body exceeds {0} bytes")]
struct BodyLimit(u64);

impl http_body::Body for LimitedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.done = true;
                self.sent.ended.store(true, Ordering::Relaxed);
                Poll::Ready(None)
            }
            Poll::Ready(Some(data)) => {
                let seen = self.seen.saturating_add(data.len() as u64);
                self.seen = seen;
                match self.limit {
                    Some(limit) if seen > limit => {
                        self.done = true;
                        self.sent.limit_hit.store(true, Ordering::SeqCst);
                        Poll::Ready(Some(Err(Box::new(BodyLimit(limit)))))
                    }
                    _ => Poll::Ready(Some(Ok(Frame::data(data)))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// Removes hop-by-hop headers, including any that `Connection` names (`relay_common::hop`).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    relay_common::hop::strip(headers);
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests;
