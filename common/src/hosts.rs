//! Which hosts a URL a peer supplies may name: host rules as operators write them (the
//! dispatcher's `[registry] forward_hosts`, the agent's `direct_hosts`), parsed once with
//! the error naming what is wrong, the address ranges behind `private`, and a URL's host
//! as the rules match it. A leaf: configs validate entries with it, the shared registry
//! checks records and the agent checks `direct_url`s with it.

use std::net::IpAddr;

/// One host rule (an entry of `[registry] forward_hosts` or the agent's `direct_hosts`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRule {
    /// IP addresses in loopback, private (RFC 1918), link-local, shared (100.64.0.0/10)
    /// and IPv6 unique-local ranges.
    Private,
    /// An address range (a single address is a full-length range).
    Net(IpAddr, u8),
    /// A host name pattern (lowercase; `*` matches any run of characters).
    Name(String),
}

impl HostRule {
    /// Parses one entry; the error says what is wrong.
    pub fn parse(s: &str) -> Result<HostRule, String> {
        if s == "private" {
            return Ok(HostRule::Private);
        }
        if let Some((ip, len)) = s.split_once('/') {
            let ip: IpAddr = ip
                .parse()
                .map_err(|_| format!("{s:?}: {ip:?} is not an IP address"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let len: u8 = len
                .parse()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("{s:?}: prefix length must be 0 to {max}"))?;
            return Ok(HostRule::Net(ip, len));
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            let len = if ip.is_ipv4() { 32 } else { 128 };
            return Ok(HostRule::Net(ip, len));
        }
        let ok = !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'*'));
        if !ok {
            return Err(format!(
                "{s:?} is not \"private\", an address range (10.0.0.0/8), an address, or a \
                 host name pattern of [A-Za-z0-9.-] and `*`"
            ));
        }
        Ok(HostRule::Name(s.to_ascii_lowercase()))
    }

    pub fn allows(&self, host: &Host) -> bool {
        match (self, host) {
            (HostRule::Private, Host::Ip(ip)) => private(*ip),
            (HostRule::Net(net, len), Host::Ip(ip)) => in_net(*ip, *net, *len),
            (HostRule::Name(p), Host::Name(n)) => crate::glob::matches_str(p, n),
            _ => false,
        }
    }
}

/// A URL's host, as `HostRule`s match it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    Ip(IpAddr),
    Name(String),
}

impl Host {
    /// The host of `url` as a dialer connects to it: an IP address (brackets of IPv6
    /// dropped, IPv4-mapped IPv6 read as IPv4), or a name in lower case without a trailing
    /// dot. `None` for a URL without a host.
    pub fn of_url(url: &str) -> Option<Host> {
        let uri: http::Uri = url.parse().ok()?;
        let host = uri.host()?;
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        Some(match bare.parse::<IpAddr>() {
            Ok(ip) => Host::Ip(ip.to_canonical()),
            Err(_) => Host::Name(bare.trim_end_matches('.').to_ascii_lowercase()),
        })
    }

    /// The rule that allows exactly this host.
    pub fn exact(&self) -> HostRule {
        match self {
            Host::Ip(ip) => HostRule::Net(*ip, if ip.is_ipv4() { 32 } else { 128 }),
            Host::Name(n) => HostRule::Name(n.clone()),
        }
    }
}

impl std::fmt::Display for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Host::Ip(ip) => ip.fmt(f),
            Host::Name(n) => f.write_str(n),
        }
    }
}

pub fn private(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || (a == 100 && b & 0xc0 == 64)
        }
        IpAddr::V6(v6) => {
            let s0 = v6.segments()[0];
            v6.is_loopback() || s0 & 0xfe00 == 0xfc00 || s0 & 0xffc0 == 0xfe80
        }
    }
}

pub fn in_net(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    match (ip.to_canonical(), net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}
