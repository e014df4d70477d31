//! The protobuf codec of every relay RPC: prost's, with smaller per-RPC buffers, an encoder
//! that lets a client reset an RPC from its request stream, and a decoder that reads each
//! message from one `Bytes` ([`RelayDecoder`]).
//!
//! tonic gives each RPC an encode buffer and a decode buffer of 8 KiB up front. A tunnel
//! server holds one long-lived `Tunnel.Connect` RPC per agent stream, most of them idle,
//! so those 16 KiB per stream were most of an idle stream's cost (10,000 idle streams took
//! 176 MiB of a server's memory). The frames that pass most often (pings, pongs, call and
//! response heads, small inline bodies) fit in far less, and a buffer grows on demand for
//! a larger message (a 64 KiB body chunk), so the buffers start at [`BUFFER_BYTES`], and
//! a `Tunnel.Connect` RPC's at [`TUNNEL_BUFFER_BYTES`] and [`TUNNEL_AGENT_BUFFER_BYTES`]
//! ([`StartBuffer`]): at 1 KiB its two buffers were still 2 KiB of an idle stream's 8.
//!
//! Before prost reads a message, the counts of its bounded repeated fields (a head's
//! header records, a fleet's members) are checked on its bytes ([`crate::bounds`]): a
//! message over a bound is refused with RESOURCE_EXHAUSTED, so a frame of tiny records is
//! never inflated into memory many times its size.
//!
//! A request stream cannot yield an error to tonic, and an RPC whose request stream is
//! left pending is never reset by hyper (dropping the response does not end the request
//! half). So a client that must abandon an RPC mid-request hands it a message that
//! [`Abandons`]: the encoder turns it into an error instead of bytes, and hyper resets
//! the RPC (RST_STREAM), which the server reads as the caller gone, never as a clean end
//! of the request. Only a `ForwardRequest` without a kind abandons (the dispatcher's way
//! to cancel a `Forward.Call` whose caller's body broke off: a clean end there would end
//! the call's body as if whole).

use crate::bounds::{Bounded, OverBound};
use bytes::Buf;
use prost::Message;
use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::ProstEncoder;

/// Initial size of an RPC's encode and decode buffers.
pub const BUFFER_BYTES: usize = 1024;

/// Initial size of a `Tunnel.Connect` RPC's buffers for `ServerFrame`s (the tunnel
/// server's encode buffer, the agent's decode buffer), whose idle traffic is a ping per
/// heartbeat (about 12 bytes) and whose largest control frame is the hello (about 100
/// bytes). `AgentFrame`s' buffers start at [`TUNNEL_AGENT_BUFFER_BYTES`]. A buffer whose earlier frames are gone is reused and grows
/// (doubling) to what the stream's calls send, then keeps that size; a stream carries one
/// call at a time, so a call's head finds the frames of the call before it gone and takes
/// no allocation, as at 1 KiB. Only a frame that comes while the one before it is still
/// held (a body chunk behind a head, each 64 KiB chunk allocating anyway) starts a new
/// buffer of its own size rather than of 1 KiB. A stream that never carried a call stays
/// at this size.
pub const TUNNEL_BUFFER_BYTES: usize = 256;

/// Initial size of a `Tunnel.Connect` RPC's buffers for `AgentFrame`s (the tunnel server's
/// decode buffer, the agent's encode buffer): an idle stream's agent sends pongs only
/// (about 12 bytes each); a response head grows the buffer as above.
pub const TUNNEL_AGENT_BUFFER_BYTES: usize = 64;

/// The initial buffer size of an RPC that sends or receives messages of this type.
pub trait StartBuffer {
    const START_BUFFER: usize = BUFFER_BYTES;
}

impl StartBuffer for crate::AgentFrame {
    const START_BUFFER: usize = TUNNEL_AGENT_BUFFER_BYTES;
}

impl StartBuffer for crate::ServerFrame {
    const START_BUFFER: usize = TUNNEL_BUFFER_BYTES;
}

macro_rules! default_buffer {
    ($($t:ty),* $(,)?) => { $(impl StartBuffer for $t {})* };
}

default_buffer!(
    crate::ServerReport,
    crate::ReportAck,
    crate::WatchRequest,
    crate::Fleet,
    crate::ForwardRequest,
    crate::ForwardResponse,
    crate::ProceedRequest,
    crate::ProceedReply,
    crate::ProbeRequest,
    crate::ProbeReply,
);

/// Bytes encoded before the encoder yields to the runtime (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// prost's codec with [`BUFFER_BYTES`] buffers; the generated clients and servers use it.
#[derive(Debug, Clone)]
pub struct RelayCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for RelayCodec<T, U> {
    fn default() -> Self {
        RelayCodec(PhantomData)
    }
}

fn settings<T: StartBuffer>() -> BufferSettings {
    BufferSettings::new(T::START_BUFFER, YIELD_THRESHOLD)
}

/// A message sent on an RPC that may stand for abandoning it (see the module docs).
pub trait Abandons {
    /// True: the RPC is reset here instead of this message being sent.
    fn abandons(&self) -> bool {
        false
    }
}

macro_rules! never_abandons {
    ($($t:ty),* $(,)?) => { $(impl Abandons for $t {})* };
}

never_abandons!(
    crate::ServerReport,
    crate::ReportAck,
    crate::WatchRequest,
    crate::Fleet,
    crate::ForwardResponse,
    crate::ProceedRequest,
    crate::ProceedReply,
    crate::ProbeRequest,
    crate::ProbeReply,
    crate::AgentFrame,
    crate::ServerFrame,
);

impl Abandons for crate::ForwardRequest {
    fn abandons(&self) -> bool {
        self.kind.is_none()
    }
}

impl crate::ForwardRequest {
    /// The message that abandons a forward RPC: the dispatcher's RPC is reset, nothing is
    /// sent (a frame without a kind is never valid on the wire).
    pub fn abandon() -> Self {
        crate::ForwardRequest { kind: None }
    }
}

/// prost's encoder, refusing a message that abandons its RPC.
#[derive(Debug)]
pub struct RelayEncoder<T>(ProstEncoder<T>);

impl<T: Message + Abandons> Encoder for RelayEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        if item.abandons() {
            return Err(Status::cancelled("the request was abandoned"));
        }
        self.0.encode(item, buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// prost's decoder, reading each message from one `Bytes` of the whole message.
///
/// prost reads a message field by field through the `Buf` it is given; tonic's `DecodeBuf`
/// passes every step (each varint, each `bytes` field's split) on to a `BytesMut`, whose
/// `advance` and `split_to` cost several times a `Bytes`' pointer arithmetic. Taken out of
/// the frame whole (a split, no copy), the message decodes from a `Bytes`: its `bytes`
/// fields (header names, values, body chunks) still share the frame's memory.
#[derive(Debug)]
pub struct RelayDecoder<U>(PhantomData<U>);

impl<U: Message + Default + Bounded + StartBuffer> Decoder for RelayDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        decode_message(buf.copy_to_bytes(buf.remaining())).map(Some)
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings::<U>()
    }
}

/// Decodes one whole message as every relay hop does: its bounded repeated fields are
/// counted on the bytes first (see [`crate::bounds`]), so a message over a bound is refused
/// with RESOURCE_EXHAUSTED before anything of it is allocated; then prost reads it. A
/// message too short to hold more entries than a bound allows
/// ([`crate::bounds::may_exceed`]: every call's heads and small frames) skips the count,
/// which was a second reading of every head, a fifteenth of a tunnel server's instructions
/// per call.
pub fn decode_message<U: Message + Default + Bounded>(message: bytes::Bytes) -> Result<U, Status> {
    if crate::bounds::may_exceed(message.len(), U::BOUNDS) {
        match crate::bounds::check(&message, U::BOUNDS) {
            Ok(()) => {}
            Err(e @ OverBound::Over(_)) => return Err(Status::resource_exhausted(e.to_string())),
            Err(e @ OverBound::Malformed(_)) => return Err(Status::internal(e.to_string())),
        }
    }
    // A message that does not parse is INTERNAL, as gRPC's status codes say.
    U::decode(message).map_err(|e| Status::internal(e.to_string()))
}

impl<T, U> Codec for RelayCodec<T, U>
where
    T: Message + Abandons + StartBuffer + Send + 'static,
    U: Message + Default + Bounded + StartBuffer + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = RelayEncoder<T>;
    type Decoder = RelayDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        RelayEncoder(ProstEncoder::new(settings::<T>()))
    }

    fn decoder(&mut self) -> Self::Decoder {
        RelayDecoder(PhantomData)
    }
}
