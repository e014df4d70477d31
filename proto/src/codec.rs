//! The protobuf codec of every relay RPC: prost's, with smaller per-RPC buffers.
//!
//! tonic gives each RPC an encode buffer and a decode buffer of 8 KiB up front. A tunnel
//! server holds one long-lived `Tunnel.Connect` RPC per agent stream, most of them idle,
//! so those 16 KiB per stream were most of an idle stream's cost (10,000 idle streams took
//! 176 MiB of a server's memory). The frames that pass most often (pings, pongs, call and
//! response heads, small inline bodies) fit in far less, and a buffer grows on demand for
//! a larger message (a 64 KiB body chunk), so the buffers start at [`BUFFER_BYTES`].

use prost::Message;
use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Initial size of an RPC's encode and decode buffers.
pub const BUFFER_BYTES: usize = 1024;

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

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_BYTES, YIELD_THRESHOLD)
}

impl<T, U> Codec for RelayCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(settings())
    }
}
