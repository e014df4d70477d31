//! Tunnel server ids and zones: 1 to 256 bytes of printable ASCII, no spaces (host names,
//! addresses, `:` and `-` fit; control characters and non-ASCII do not). A tunnel server's
//! config is checked with [`is_valid`], and a dispatcher refuses a report stream or a shared
//! record naming anything else, so an id is safe to write into a log line as it is.

/// Longest server id or zone, in bytes.
pub const MAX_LEN: usize = 256;

/// The rule, for error messages.
pub const RULE: &str = "1 to 256 bytes of printable ASCII without spaces";

/// Whether `id` is a well-formed server id (or zone).
pub fn is_valid(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_LEN && id.bytes().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_ascii_without_spaces_up_to_the_limit() {
        for ok in [
            "ts-1",
            "127.0.0.1:8441",
            "[::1]:8441",
            "eu-west/a_1",
            &"a".repeat(MAX_LEN),
        ] {
            assert!(is_valid(ok), "{ok:?}");
        }
        let long = "a".repeat(MAX_LEN + 1);
        for bad in [
            "",
            " ",
            "ts 1",
            "ts-1\n",
            "ts\u{1b}[31m",
            "tś-1",
            "ts\t1",
            long.as_str(),
        ] {
            assert!(!is_valid(bad), "{bad:?}");
        }
    }
}
