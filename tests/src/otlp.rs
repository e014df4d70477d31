//! An OTLP trace collector for tests: a real gRPC `TraceService` on loopback that keeps
//! every span it receives, with the service name of the process that sent it.

use std::net::SocketAddr;
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// One received span, its ids as lowercase hex (the parent empty for a root span).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// The span's attributes whose values are strings or integers, as text.
    pub attributes: Vec<(String, String)>,
}

#[derive(Default)]
struct Received(Mutex<Vec<ReceivedSpan>>);

/// The service: appends what it receives to the shared list.
struct Service(Arc<Received>);

#[tonic::async_trait]
impl TraceService for Service {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = Vec::new();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref())
                .and_then(|v| v.value.as_ref())
                .map(text)
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(ReceivedSpan {
                        service: service.clone(),
                        name: span.name,
                        trace_id: hex::encode(&span.trace_id),
                        span_id: hex::encode(&span.span_id),
                        parent_span_id: hex::encode(&span.parent_span_id),
                        attributes: span
                            .attributes
                            .iter()
                            .filter_map(|kv| {
                                let value = kv.value.as_ref()?.value.as_ref()?;
                                Some((kv.key.clone(), text(value)))
                            })
                            .collect(),
                    });
                }
            }
        }
        self.0 .0.lock().extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::BoolValue(b) => b.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// A running collector; stops when dropped.
pub struct Collector {
    addr: SocketAddr,
    received: Arc<Received>,
    stop: CancellationToken,
}

impl Collector {
    /// Binds a loopback port and serves OTLP/gRPC there.
    pub async fn start() -> std::io::Result<Collector> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let received = Arc::new(Received::default());
        let stop = CancellationToken::new();
        let service = TraceServiceServer::new(Service(received.clone()));
        let stopped = stop.clone().cancelled_owned();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    stopped,
                ),
        );
        Ok(Collector {
            addr,
            received,
            stop,
        })
    }

    /// The endpoint for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received.0.lock().clone()
    }

    /// The spans received so far of one trace.
    pub fn trace(&self, trace_id: &str) -> Vec<ReceivedSpan> {
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
