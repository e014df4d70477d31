//! Trace context across the hops (W3C Trace Context) and spans exported over OTLP.
//!
//! A call carries one trace id from the backend to the upstream. The dispatcher reads the
//! backend's `traceparent` header, or starts a trace when there is none or it is malformed;
//! each process then opens its own span for the call ([`CallTrace`]): a fresh span id
//! whose parent is the span of the hop before. The dispatcher passes its span id to the
//! tunnel server in the call's head (a typed field, so the tunnel server, which never
//! decodes headers, reads it as it reads the method), the tunnel server passes its own to
//! the agent the same way, and the agent writes `traceparent` on the upstream request with
//! its span as the parent. `tracestate` is a header like any other and reaches the upstream
//! unchanged.
//!
//! Every log line of a call carries its `trace_id`. Spans leave the process only when OTLP
//! export is switched on ([`init_export`], from the standard OpenTelemetry variables): one
//! span per hop, built when the call ends from what the call already knows (no span object
//! lives through the call, and nothing is allocated for it while export is off), handed to
//! the OpenTelemetry SDK's batch processor, which drops spans rather than wait when its
//! queue is full, so a slow or absent collector never holds a call.

use std::fmt;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{SpanContext, Status, TraceFlags, TraceState};
use opentelemetry::InstrumentationScope;
/// What a span's `end` takes, re-exported so the binaries need no OpenTelemetry crate.
pub use opentelemetry::{trace::SpanKind, KeyValue};
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, SpanData, SpanEvents, SpanLinks, SpanProcessor,
};
use opentelemetry_sdk::Resource;

/// The `traceparent` header's name.
pub const TRACEPARENT: &str = "traceparent";
/// The `traceparent` header's name as a header name (no parse per use).
pub const TRACEPARENT_HEADER: http::HeaderName = http::HeaderName::from_static(TRACEPARENT);
/// The `tracestate` header's name.
pub const TRACESTATE: &str = "tracestate";

/// A trace id: 16 bytes, never all zero. Shown as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

/// A span id: 8 bytes, never all zero. Shown as 16 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

/// Random ids, from a SplitMix64 sequence per thread seeded from the operating system's
/// generator when the thread first needs one: a few instructions per id, against the tens
/// of nanoseconds of a cryptographic generator on every call of every hop. Trace ids must be
/// unique and spread (W3C Trace Context), not secret.
fn next_random() -> u64 {
    thread_local! {
        static STATE: std::cell::Cell<u64> = std::cell::Cell::new(rand::random());
    }
    STATE.with(|state| {
        let s = state.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        state.set(s);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

impl TraceId {
    fn random() -> Self {
        loop {
            let id = (u128::from(next_random()) << 64) | u128::from(next_random());
            if id != 0 {
                return TraceId(id.to_be_bytes());
            }
        }
    }

    /// The id from its bytes, `None` unless 16 bytes and not all zero.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        let id: [u8; 16] = bytes.try_into().ok()?;
        (id != [0; 16]).then_some(TraceId(id))
    }
}

impl SpanId {
    fn random() -> Self {
        loop {
            let id = next_random();
            if id != 0 {
                return SpanId(id.to_be_bytes());
            }
        }
    }

    /// The id as the integer the call head carries (`fixed64`, big-endian bytes).
    pub fn to_u64(self) -> u64 {
        u64::from_be_bytes(self.0)
    }

    /// The id from the call head's integer, `None` for 0.
    pub fn from_u64(id: u64) -> Option<Self> {
        (id != 0).then_some(SpanId(id.to_be_bytes()))
    }
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 32];
    for (i, b) in bytes.iter().enumerate() {
        buf[2 * i] = HEX[usize::from(b >> 4)];
        buf[2 * i + 1] = HEX[usize::from(b & 0xf)];
    }
    // Only ASCII hex digits were written.
    f.write_str(std::str::from_utf8(&buf[..2 * bytes.len()]).unwrap_or_default())
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl fmt::Debug for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The `sampled` bit of the trace flags.
pub const SAMPLED: u8 = 0x01;

/// What a hop receives: the trace, the span of the hop before (its parent) and the flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: TraceId,
    pub parent_id: SpanId,
    pub flags: u8,
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn parse_hex<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in text.chunks_exact(2).enumerate() {
        out[i] = (hex_digit(pair[0])? << 4) | hex_digit(pair[1])?;
    }
    Some(out)
}

impl TraceContext {
    /// Parses a `traceparent` value as W3C Trace Context level 1 reads it:
    /// `version-traceid-parentid-flags`, lowercase hex. Version `ff` and all-zero ids are
    /// invalid; a later version than `00` is read by its first four fields when the value
    /// goes on with a `-`. Anything else is `None`, and the caller starts a new trace.
    pub fn from_traceparent(value: &[u8]) -> Option<Self> {
        let value = value.trim_ascii();
        if value.len() < 55 {
            return None;
        }
        let version = parse_hex::<1>(&value[0..2])?[0];
        let rest_ok = match version {
            0xff => false,
            0x00 => value.len() == 55,
            _ => value.len() == 55 || value[55] == b'-',
        };
        if !rest_ok || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let trace_id = TraceId::from_slice(&parse_hex::<16>(&value[3..35])?)?;
        let parent = parse_hex::<8>(&value[36..52])?;
        if parent == [0; 8] {
            return None;
        }
        let flags = parse_hex::<1>(&value[53..55])?[0];
        Some(TraceContext {
            trace_id,
            parent_id: SpanId(parent),
            flags,
        })
    }

    /// The context from the fields a call head carries (`relay.v1.TraceParent`: the trace
    /// id's big-endian halves, the parent span id, the flags); `None` when the trace id or
    /// the parent is zero (a peer that sent none).
    pub fn from_head(
        trace_id_high: u64,
        trace_id_low: u64,
        parent_id: u64,
        flags: u32,
    ) -> Option<Self> {
        let id = (u128::from(trace_id_high) << 64) | u128::from(trace_id_low);
        Some(TraceContext {
            trace_id: TraceId::from_slice(&id.to_be_bytes())?,
            parent_id: SpanId::from_u64(parent_id)?,
            flags: (flags & 0xff) as u8,
        })
    }

    /// The fields a call head carries, in [`TraceContext::from_head`]'s order.
    pub fn to_head(&self) -> (u64, u64, u64, u32) {
        let id = u128::from_be_bytes(self.trace_id.0);
        (
            (id >> 64) as u64,
            id as u64,
            self.parent_id.to_u64(),
            u32::from(self.flags),
        )
    }
}

/// One process's span of one call: its trace, its own span id and its parent.
#[derive(Clone, Copy, Debug)]
pub struct CallTrace {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    /// The hop before's span; `None` when this process started the trace.
    pub parent_id: Option<SpanId>,
    pub flags: u8,
    /// When the span began, taken only when the span will be exported.
    start: Option<SystemTime>,
}

impl CallTrace {
    /// Opens this process's span of a call that arrived with `incoming` (the hop before's
    /// context), or starts a trace when it arrived with none. A started trace is sampled:
    /// whether a span is exported is each process's own choice ([`init_export`]), and a
    /// collector that wants fewer samples them there.
    pub fn begin(incoming: Option<TraceContext>) -> Self {
        let (trace_id, parent_id, flags) = match incoming {
            Some(cx) => (cx.trace_id, Some(cx.parent_id), cx.flags),
            None => (TraceId::random(), None, SAMPLED),
        };
        let start = (flags & SAMPLED != 0 && exporting()).then(crate::wall::now);
        CallTrace {
            trace_id,
            span_id: SpanId::random(),
            parent_id,
            flags,
            start,
        }
    }

    /// The call head's fields for the next hop (`relay.v1.TraceParent`: trace id high and
    /// low halves, this span as the parent, flags).
    pub fn to_head(&self) -> (u64, u64, u64, u32) {
        self.child_context().to_head()
    }

    /// This process's span of a call whose head carried `(high, low, parent, flags)`, or
    /// a `traceparent` header (a peer that does not fill the head's field), or neither.
    pub fn from_head_or_header(head: Option<(u64, u64, u64, u32)>, header: Option<&[u8]>) -> Self {
        let incoming = head
            .and_then(|(high, low, parent, flags)| {
                TraceContext::from_head(high, low, parent, flags)
            })
            .or_else(|| header.and_then(TraceContext::from_traceparent));
        CallTrace::begin(incoming)
    }

    /// The context the next hop receives: this span as its parent.
    pub fn child_context(&self) -> TraceContext {
        TraceContext {
            trace_id: self.trace_id,
            parent_id: self.span_id,
            flags: self.flags,
        }
    }

    /// The `traceparent` value for the next hop (version 00, this span as the parent):
    /// 55 ASCII bytes, written without an allocation.
    pub fn traceparent(&self) -> [u8; 55] {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [b'-'; 55];
        out[0] = b'0';
        out[1] = b'0';
        let mut put = |at: usize, bytes: &[u8]| {
            for (i, b) in bytes.iter().enumerate() {
                out[at + 2 * i] = HEX[usize::from(b >> 4)];
                out[at + 2 * i + 1] = HEX[usize::from(b & 0xf)];
            }
        };
        put(3, &self.trace_id.0);
        put(36, &self.span_id.0);
        put(53, &[self.flags]);
        out
    }

    /// Whether this span will be exported when it ends (export is on and the trace is
    /// sampled): what only the exported span needs is kept only then.
    pub fn exported(&self) -> bool {
        self.start.is_some()
    }

    /// Ends the span: exports it when export is on and the trace is sampled, otherwise
    /// does nothing. `attributes` is called only when the span is exported. `error` marks
    /// the span as failed with that description.
    pub fn end(
        &self,
        name: &'static str,
        kind: SpanKind,
        error: Option<&str>,
        attributes: impl FnOnce() -> Vec<KeyValue>,
    ) {
        let (Some(start), Some(export)) = (self.start, EXPORT.get()) else {
            return;
        };
        let status = match error {
            Some(description) => Status::error(description.to_string()),
            None => Status::Unset,
        };
        export.processor.on_end(SpanData {
            span_context: SpanContext::new(
                opentelemetry::trace::TraceId::from_bytes(self.trace_id.0),
                opentelemetry::trace::SpanId::from_bytes(self.span_id.0),
                TraceFlags::new(self.flags),
                false,
                TraceState::NONE,
            ),
            parent_span_id: self
                .parent_id
                .map_or(opentelemetry::trace::SpanId::INVALID, |p| {
                    opentelemetry::trace::SpanId::from_bytes(p.0)
                }),
            parent_span_is_remote: self.parent_id.is_some(),
            span_kind: kind,
            name: name.into(),
            start_time: start,
            end_time: crate::wall::now(),
            attributes: attributes(),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: export.scope.clone(),
        });
    }
}

struct Export {
    processor: BatchSpanProcessor,
    scope: InstrumentationScope,
}

static EXPORT: OnceLock<Export> = OnceLock::new();

/// Whether spans leave this process.
pub fn exporting() -> bool {
    EXPORT.get().is_some()
}

/// The OTLP endpoint the standard variables name for traces, if export is on:
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`; none when
/// neither is set or `OTEL_TRACES_EXPORTER` is `none`. An endpoint that is not an
/// `http://` or `https://` URL is an error naming the variable.
pub fn endpoint_from_env() -> Result<Option<String>, String> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim() == "none") {
        return Ok(None);
    }
    let Some((name, endpoint)) = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .into_iter()
    .find_map(|name| var(name).map(|v| (name, v.trim().to_string()))) else {
        return Ok(None);
    };
    match endpoint.parse::<http::Uri>() {
        Ok(uri)
            if matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some() =>
        {
            Ok(Some(endpoint))
        }
        _ => Err(format!(
            "environment variable {name}: {endpoint:?} is not an http:// or https:// URL of an OTLP/gRPC collector"
        )),
    }
}

/// Flushes the spans still queued when dropped. Hold it for the process's life.
#[must_use = "dropping the guard flushes and stops span export"]
pub struct ExportGuard(());

impl Drop for ExportGuard {
    fn drop(&mut self) {
        if let Some(export) = EXPORT.get() {
            let _ = export
                .processor
                .shutdown_with_timeout(Duration::from_secs(2));
        }
    }
}

/// Switches OTLP span export (gRPC) on when the standard variables ask for it
/// ([`endpoint_from_env`]); `service` is the service name unless `OTEL_SERVICE_NAME`
/// gives one. Off by default: without an endpoint this returns `Ok(None)` and spans cost
/// nothing. The exporter's connection runs on a thread of its own with its own runtime,
/// and the SDK's batch processor on another, so export never takes time from a call's
/// runtime; `OTEL_BSP_*` variables tune the batch processor.
pub fn init_export(service: &str) -> Result<Option<ExportGuard>, String> {
    let Some(endpoint) = endpoint_from_env()? else {
        return Ok(None);
    };
    let (built_tx, built_rx) = std::sync::mpsc::channel();
    let endpoint_for_thread = endpoint.clone();
    std::thread::Builder::new()
        .name("relay-otlp".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = built_tx.send(Err(format!("cannot start the OTLP runtime: {e}")));
                    return;
                }
            };
            runtime.block_on(async move {
                use opentelemetry_otlp::WithExportConfig;
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint_for_thread)
                    .build()
                    .map_err(|e| format!("OTLP exporter: {e}"));
                let _ = built_tx.send(exporter);
                // The exporter's channel runs on this runtime for the process's life.
                std::future::pending::<()>().await
            })
        })
        .map_err(|e| format!("cannot start the OTLP thread: {e}"))?;
    let exporter = built_rx
        .recv()
        .map_err(|_| "the OTLP thread ended before its exporter was built".to_string())??;
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| service.to_string());
    let mut processor = BatchSpanProcessor::builder(exporter).build();
    processor.set_resource(&Resource::builder().with_service_name(service).build());
    let scope = InstrumentationScope::builder("relay")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    EXPORT
        .set(Export { processor, scope })
        .map_err(|_| "OTLP export was already switched on".to_string())?;
    tracing::info!(%endpoint, "exporting spans over OTLP");
    Ok(Some(ExportGuard(())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn reads_the_specs_example() {
        let cx = TraceContext::from_traceparent(SAMPLE.as_bytes()).unwrap();
        assert_eq!(cx.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.parent_id.to_string(), "00f067aa0ba902b7");
        assert_eq!(cx.flags, SAMPLED);
    }

    #[test]
    fn refuses_what_the_spec_refuses() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            // upper case, all-zero ids, version ff, bad separators, trailing data on 00
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "<script>-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba9",
        ] {
            assert_eq!(
                TraceContext::from_traceparent(bad.as_bytes()),
                None,
                "{bad}"
            );
        }
    }

    #[test]
    fn reads_a_later_version_by_its_first_fields() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        let cx = TraceContext::from_traceparent(later.as_bytes()).unwrap();
        assert_eq!(cx.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(
            TraceContext::from_traceparent(&later.as_bytes()[..55]),
            Some(cx)
        );
    }

    #[test]
    fn a_hop_keeps_the_trace_and_parents_the_next() {
        let incoming = TraceContext::from_traceparent(SAMPLE.as_bytes()).unwrap();
        let hop = CallTrace::begin(Some(incoming));
        assert_eq!(hop.trace_id, incoming.trace_id);
        assert_eq!(hop.parent_id, Some(incoming.parent_id));
        assert_ne!(hop.span_id, incoming.parent_id);
        let next = TraceContext::from_traceparent(&hop.traceparent()).unwrap();
        assert_eq!(
            std::str::from_utf8(&hop.traceparent()).unwrap(),
            format!("00-{}-{}-01", hop.trace_id, hop.span_id)
        );
        assert_eq!(next, hop.child_context());
        assert_eq!(next.parent_id, hop.span_id);
        let (high, low, parent, flags) = hop.child_context().to_head();
        assert_eq!(
            TraceContext::from_head(high, low, parent, flags),
            Some(next)
        );
    }

    #[test]
    fn a_call_without_context_starts_a_sampled_trace() {
        let a = CallTrace::begin(None);
        let b = CallTrace::begin(None);
        assert_eq!(a.parent_id, None);
        assert_ne!(a.trace_id, b.trace_id);
        assert_eq!(a.flags, SAMPLED);
        assert!(a.traceparent().ends_with(b"-01"));
    }

    #[test]
    fn started_traces_and_spans_never_repeat_across_threads() {
        let ids = |n: usize| {
            (0..n)
                .map(|_| {
                    let t = CallTrace::begin(None);
                    (t.trace_id.0, t.span_id.0)
                })
                .collect::<Vec<_>>()
        };
        let mut all = ids(10_000);
        all.extend(std::thread::spawn(move || ids(10_000)).join().unwrap());
        let traces: std::collections::HashSet<_> = all.iter().map(|(t, _)| *t).collect();
        let spans: std::collections::HashSet<_> = all.iter().map(|(_, s)| *s).collect();
        assert_eq!(traces.len(), all.len());
        assert_eq!(spans.len(), all.len());
    }

    #[test]
    fn missing_head_fields_read_as_no_context() {
        assert_eq!(TraceContext::from_head(0, 0, 7, 1), None);
        assert_eq!(TraceContext::from_head(1, 1, 0, 1), None);
        assert!(TraceContext::from_head(0, 1, 7, 1).is_some());
    }
}
