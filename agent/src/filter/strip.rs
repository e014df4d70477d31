//! The head's headers: copied into a `HeaderMap` after the override-header check, the
//! hop-by-hop headers and those `Connection` names removed, and the body's framing
//! checked (one valid `Content-Length` or chunked, never both).

use super::*;

/// Headers the agent may add to a call's request after this map is built.
const ADDED_HEADERS: usize = 4;

/// The head's headers as a `HeaderMap`, after the override-header check.
pub(super) fn header_map(head: &RequestHead) -> Result<HeaderMap, Rejection> {
    // Sized once by the count, which `limits.max_headers` bounds before this runs, with
    // room for the headers the agent adds on the way out (`Host`, `traceparent`,
    // `Connection: close`, a rule's `X-Forwarded-For`): a map grown by one insert more
    // than it was sized for rehashes every header (in callgrind, about 1,800 instructions
    // of a call's 52,000 for `traceparent` alone).
    let mut headers = HeaderMap::with_capacity(head.headers.len() + ADDED_HEADERS);
    for record in &head.headers {
        // `prepare` refused a head with a record that does not parse before this runs.
        let (name, value) = relay_proto::parse_header(record)
            .map_err(|e| Rejection::BadRequest(format!("the request head has {e}")))?;
        let name = HeaderName::from_bytes(name).map_err(|_| {
            Rejection::BadRequest(format!(
                "invalid header name {:?}",
                short(&String::from_utf8_lossy(name))
            ))
        })?;
        // The value shares the frame's bytes (checked, not copied).
        let value = HeaderValue::from_maybe_shared(record.slice_ref(value))
            .map_err(|_| Rejection::BadRequest(format!("invalid value for header {name}")))?;
        let overrides = OVERRIDE_HEADERS.contains(&&*dashed(name.as_str()))
            || (name == http::header::FORWARDED
                && value
                    .as_bytes()
                    .to_ascii_lowercase()
                    .windows(5)
                    .any(|w| w == b"host="));
        if overrides {
            return Err(Rejection::refused(
                Reason::OverrideHeader,
                format!("header {name} asks for another host, URL or method and is refused"),
            ));
        }
        headers.append(name, value);
    }
    Ok(headers)
}

/// Removes the hop-by-hop headers, every header `Connection` names, and the `_`
/// spellings of the spoofing headers. A `Connection` naming `Content-Length` would
/// change the body's framing after it was checked: refused as smuggling.
pub(super) fn strip_connection_headers(headers: &mut HeaderMap) -> Result<(), Rejection> {
    let names_length = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .any(|n| n.trim_ascii().eq_ignore_ascii_case(b"content-length"));
    if names_length {
        return Err(Rejection::refused(
            Reason::Smuggling,
            "connection names content-length",
        ));
    }
    relay_common::hop::strip(headers);
    let underscored: Vec<HeaderName> = headers
        .keys()
        .filter(|n| spoofing(n.as_str()) == Some(true))
        .cloned()
        .collect();
    for n in underscored {
        headers.remove(n);
    }
    Ok(())
}

/// Checks message framing; returns the declared Content-Length.
pub(super) fn framing(headers: &HeaderMap, no_body: bool) -> Result<Option<u64>, Rejection> {
    let smuggling = |why: String| Rejection::refused(Reason::Smuggling, why);
    let lengths: Vec<&HeaderValue> = headers
        .get_all(http::header::CONTENT_LENGTH)
        .iter()
        .collect();
    let encodings: Vec<&HeaderValue> = headers
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .collect();
    if lengths.len() > 1 {
        return Err(smuggling("duplicate content-length headers".into()));
    }
    let length = match lengths.first() {
        None => None,
        Some(v) => {
            let b = v.as_bytes();
            if b.is_empty() || b.len() > 19 || !b.iter().all(u8::is_ascii_digit) {
                return Err(smuggling(
                    "content-length is not a plain decimal number".into(),
                ));
            }
            let n = std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| smuggling("content-length is not a plain decimal number".into()))?;
            Some(n)
        }
    };
    if !encodings.is_empty() {
        if length.is_some() {
            return Err(smuggling(
                "content-length together with transfer-encoding".into(),
            ));
        }
        let chunked_only = encodings.len() == 1
            && encodings[0]
                .to_str()
                .is_ok_and(|s| s.trim().eq_ignore_ascii_case("chunked"));
        if !chunked_only {
            return Err(smuggling(
                "transfer-encoding other than a single 'chunked'".into(),
            ));
        }
    }
    if no_body && length.is_some_and(|n| n > 0) {
        return Err(smuggling(
            "content-length announces a body but the request has none".into(),
        ));
    }
    Ok(length)
}
