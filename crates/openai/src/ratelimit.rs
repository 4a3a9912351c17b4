//! The `x-ratelimit-*` response headers (OpenAI's, and the servers that copy them) →
//! [`Observed`]. Pure: header lookups in, values out.
//!
//! `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
//! `x-ratelimit-reset-requests`, and the same with `-tokens`. A reset is a Go-style
//! duration (`1s`, `6m0s`, `20ms`, `1h2m3.5s`) or plain seconds (`0.5`). A part is kept only
//! when its `remaining` and `reset` both parse; the limit is optional.
//!
//! A 429 with `Retry-After` says the same in other words: no request until then. It
//! becomes a requests window with nothing remaining for that long ([`from_response`]), so
//! the worker sends no other call to the server before it (and a job that cannot wait that
//! long ends without a call, `admission:rate_limited`). The rate limiter cuts any window to
//! the breaker's longest cool-down: a header is advice, not an order.

use lastcall_backend::rate_limit::{Observed, Window};

/// The rate-limit state a response's headers state; `header(name)` looks a header up
/// (lower-case name).
pub fn parse_headers<'a>(header: impl Fn(&str) -> Option<&'a str>) -> Observed {
    let window = |what: &str| {
        let limit = header(&format!("x-ratelimit-limit-{what}")).and_then(parse_count);
        let remaining = header(&format!("x-ratelimit-remaining-{what}")).and_then(parse_count)?;
        let reset_ms = header(&format!("x-ratelimit-reset-{what}")).and_then(parse_reset_ms)?;
        Some(Window {
            limit,
            remaining,
            reset_ms,
        })
    };
    Observed {
        requests: window("requests"),
        tokens: window("tokens"),
    }
}

/// [`parse_headers`] for a response of `status`: a 429 with a `Retry-After` (seconds)
/// also holds requests for that long (the longer of it and the headers' reset).
pub fn from_response<'a>(status: u16, header: impl Fn(&str) -> Option<&'a str>) -> Observed {
    let mut o = parse_headers(&header);
    let retry_after_ms = (status == 429)
        .then(|| header("retry-after").and_then(crate::classify::parse_retry_after))
        .flatten()
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    if let Some(ra) = retry_after_ms.filter(|ms| *ms > 0) {
        let w = o.requests.unwrap_or(Window {
            limit: None,
            remaining: 0,
            reset_ms: 0,
        });
        o.requests = Some(Window {
            remaining: 0,
            reset_ms: w.reset_ms.max(ra),
            ..w
        });
    }
    o
}

fn parse_count(v: &str) -> Option<u64> {
    v.trim().parse().ok()
}

/// The longest reset honoured: a day (a larger plain number is likely a timestamp).
const MAX_RESET_MS: f64 = 86_400_000.0;

/// A reset duration in ms, rounded up: `6m0s`, `1s`, `20ms`, `1.5s`, `0.5` (seconds).
pub fn parse_reset_ms(v: &str) -> Option<u64> {
    let v = v.trim();
    if v.is_empty() {
        return None;
    }
    let ms = if let Ok(secs) = v.parse::<f64>() {
        secs * 1_000.0
    } else {
        let mut total = 0.0;
        let mut rest = v;
        while !rest.is_empty() {
            let num_len = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(rest.len());
            let n: f64 = rest[..num_len].parse().ok()?;
            rest = &rest[num_len..];
            let unit_len = rest
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(rest.len());
            let factor = match &rest[..unit_len] {
                "h" => 3_600_000.0,
                "m" => 60_000.0,
                "s" => 1_000.0,
                "ms" => 1.0,
                "us" | "µs" => 0.001,
                "ns" => 0.000_001,
                _ => return None,
            };
            total += n * factor;
            rest = &rest[unit_len..];
        }
        total
    };
    (ms.is_finite() && (0.0..=MAX_RESET_MS).contains(&ms)).then(|| ms.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn durations_in_the_forms_servers_send() {
        for (text, ms) in [
            ("1s", 1_000),
            ("6m0s", 360_000),
            ("20ms", 20),
            ("1h2m3.5s", 3_723_500),
            ("59.001s", 59_001),
            ("0s", 0),
            ("0.5", 500),
            ("7", 7_000),
            ("150us", 1),
        ] {
            assert_eq!(parse_reset_ms(text), Some(ms), "{text}");
        }
        for bad in ["", "s", "1d", "-1s", "1x", "1733400000", "abc"] {
            assert_eq!(parse_reset_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn openai_headers_become_windows() {
        let h: HashMap<&str, &str> = [
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]
        .into();
        let o = parse_headers(|n| h.get(n).copied());
        assert_eq!(
            o.requests,
            Some(Window {
                limit: Some(60),
                remaining: 59,
                reset_ms: 1_000
            })
        );
        assert_eq!(
            o.tokens,
            Some(Window {
                limit: Some(150_000),
                remaining: 149_984,
                reset_ms: 360_000
            })
        );
    }

    #[test]
    fn a_429_with_retry_after_holds_requests_for_that_long() {
        let h: HashMap<&str, &str> = [("retry-after", "2")].into();
        let o = from_response(429, |n| h.get(n).copied());
        assert_eq!(
            o.requests,
            Some(Window {
                limit: None,
                remaining: 0,
                reset_ms: 2_000
            })
        );
        // A 503's Retry-After is the circuit breaker's business, not a rate limit.
        assert!(from_response(503, |n| h.get(n).copied()).is_empty());
        // With headers: nothing remaining, until the later of the two.
        let h: HashMap<&str, &str> = [
            ("retry-after", "2"),
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "3"),
            ("x-ratelimit-reset-requests", "5s"),
        ]
        .into();
        let o = from_response(429, |n| h.get(n).copied());
        assert_eq!(
            o.requests,
            Some(Window {
                limit: Some(60),
                remaining: 0,
                reset_ms: 5_000
            })
        );
    }

    #[test]
    fn a_part_without_remaining_or_reset_is_left_out() {
        let h: HashMap<&str, &str> = [
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-remaining-tokens", "10"),
            ("x-ratelimit-reset-tokens", "soon"),
        ]
        .into();
        assert!(parse_headers(|n| h.get(n).copied()).is_empty());
        let none: HashMap<&str, &str> = HashMap::new();
        assert!(parse_headers(|n| none.get(n).copied()).is_empty());
    }
}
