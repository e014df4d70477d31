//! The PROXY protocol header (v1 text or v2 binary) that a TCP load balancer writes before
//! a connection's first byte to name the client it accepted (HAProxy `send-proxy`,
//! `send-proxy-v2`; AWS NLB, GCP, Envoy alike).
//!
//! [`read`] takes the header off the socket byte-exact (nothing after it is consumed, so TLS
//! or HTTP starts right behind it) and parses it with the `ppp` crate. It must only be used
//! on connections from configured load balancer addresses: anyone else could name any
//! source they like.

use std::net::SocketAddr;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The v2 signature (12 bytes) starts with these; a v1 header with `PROXY`.
const V2_START: &[u8; 5] = b"\r\n\r\n\0";
const V1_START: &[u8; 5] = b"PROXY";
/// Longest v1 header (the spec's 107 bytes).
const V1_MAX: usize = 107;
/// Longest v2 header taken: 16 bytes and the addresses and TLVs. Load balancers send a
/// few dozen bytes of TLVs at most; the protocol's own bound is 64 KiB.
pub const V2_MAX: usize = 16 + 2048;

/// Why a header was refused (the connection is closed).
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("reading the PROXY header: {0}")]
    Io(#[from] std::io::Error),
    #[error(
        "no PROXY protocol header (the connection comes from a configured load balancer address)"
    )]
    Missing,
    #[error("PROXY v1 header longer than 107 bytes")]
    V1TooLong,
    #[error("PROXY v2 header of {0} bytes, more than {V2_MAX}")]
    V2TooLong(usize),
    #[error("malformed PROXY header: {0}")]
    Malformed(String),
}

/// Reads one PROXY header from `io`: the client's address, or `None` when the header names
/// none (v2 `LOCAL`, as in the load balancer's own health checks; v1 `UNKNOWN`; a Unix or
/// unspecified family): the connection is then the load balancer's own.
pub async fn read<R: AsyncRead + Unpin>(io: &mut R) -> Result<Option<SocketAddr>, ProxyError> {
    let mut buf = vec![0u8; 5];
    io.read_exact(&mut buf).await?;
    if buf.as_slice() == V1_START {
        // Byte by byte up to the CRLF: nothing past the header may be consumed.
        while !buf.ends_with(b"\r\n") {
            if buf.len() >= V1_MAX {
                return Err(ProxyError::V1TooLong);
            }
            buf.push(io.read_u8().await?);
        }
        let header = ppp::v1::Header::try_from(buf.as_slice())
            .map_err(|e| ProxyError::Malformed(e.to_string()))?;
        return Ok(match header.addresses {
            ppp::v1::Addresses::Tcp4(a) => {
                Some(SocketAddr::from((a.source_address, a.source_port)))
            }
            ppp::v1::Addresses::Tcp6(a) => {
                Some(SocketAddr::from((a.source_address, a.source_port)))
            }
            ppp::v1::Addresses::Unknown => None,
        });
    }
    if buf.as_slice() != V2_START {
        return Err(ProxyError::Missing);
    }
    buf.resize(16, 0);
    io.read_exact(&mut buf[5..]).await?;
    let len = 16 + usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    if len > V2_MAX {
        return Err(ProxyError::V2TooLong(len));
    }
    buf.resize(len, 0);
    io.read_exact(&mut buf[16..]).await?;
    let header = ppp::v2::Header::try_from(buf.as_slice())
        .map_err(|e| ProxyError::Malformed(e.to_string()))?;
    if header.command == ppp::v2::Command::Local {
        return Ok(None);
    }
    Ok(match header.addresses {
        ppp::v2::Addresses::IPv4(a) => Some(SocketAddr::from((a.source_address, a.source_port))),
        ppp::v2::Addresses::IPv6(a) => Some(SocketAddr::from((a.source_address, a.source_port))),
        ppp::v2::Addresses::Unspecified | ppp::v2::Addresses::Unix(_) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parse(bytes: &[u8]) -> (Result<Option<SocketAddr>, ProxyError>, Vec<u8>) {
        let mut r = bytes;
        let got = read(&mut r).await;
        (got, r.to_vec())
    }

    #[tokio::test]
    async fn v1_and_v2_name_the_client_and_leave_the_rest_unread() {
        let (got, rest) = parse(b"PROXY TCP4 192.0.2.7 10.0.0.1 51234 443\r\nGET /").await;
        assert_eq!(got.unwrap(), Some("192.0.2.7:51234".parse().unwrap()));
        assert_eq!(rest, b"GET /");
        let (got, _) = parse(b"PROXY TCP6 2001:db8::7 2001:db8::1 4000 443\r\n").await;
        assert_eq!(got.unwrap(), Some("[2001:db8::7]:4000".parse().unwrap()));
        let (got, _) = parse(b"PROXY UNKNOWN\r\n").await;
        assert_eq!(got.unwrap(), None);

        let addrs: ppp::v2::Addresses = (
            "198.51.100.9:6000".parse::<SocketAddr>().unwrap(),
            "10.0.0.1:8441".parse::<SocketAddr>().unwrap(),
        )
            .into();
        let mut v2 = ppp::v2::Builder::with_addresses(
            ppp::v2::Version::Two | ppp::v2::Command::Proxy,
            ppp::v2::Protocol::Stream,
            addrs,
        )
        .write_tlv(ppp::v2::Type::NoOp, &[0; 8])
        .unwrap()
        .build()
        .unwrap();
        v2.extend_from_slice(b"PRI * HTTP/2.0");
        let (got, rest) = parse(&v2).await;
        assert_eq!(got.unwrap(), Some("198.51.100.9:6000".parse().unwrap()));
        assert_eq!(rest, b"PRI * HTTP/2.0");

        let local = ppp::v2::Builder::with_addresses(
            ppp::v2::Version::Two | ppp::v2::Command::Local,
            ppp::v2::Protocol::Unspecified,
            ppp::v2::Addresses::Unspecified,
        )
        .build()
        .unwrap();
        assert_eq!(parse(&local).await.0.unwrap(), None, "a health check");
    }

    #[tokio::test]
    async fn a_connection_without_a_valid_header_is_refused() {
        assert!(matches!(
            parse(b"GET / HTTP/1.1\r\n\r\n").await.0,
            Err(ProxyError::Missing)
        ));
        assert!(matches!(
            parse(b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 and then some more bytes that never end with a line break xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx").await.0,
            Err(ProxyError::V1TooLong)
        ));
        assert!(matches!(
            parse(b"PROXY TCP4 not-an-address 5.6.7.8 1 2\r\n").await.0,
            Err(ProxyError::Malformed(_))
        ));
        let mut huge = b"\r\n\r\n\0\r\nQUIT\n\x21\x11".to_vec();
        huge.extend_from_slice(&60_000u16.to_be_bytes());
        assert!(matches!(
            parse(&huge).await.0,
            Err(ProxyError::V2TooLong(_))
        ));
        assert!(matches!(parse(b"PRO").await.0, Err(ProxyError::Io(_))));
    }
}
