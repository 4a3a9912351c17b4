//! Token deltas: the text of a streaming model call as it is generated, sent by the worker
//! to the request that waits for it (`lastcall serve`'s `stream: true` front door) over
//! the job's AMQP `reply_to` (docs/wire-format.md §10). Pure.
//!
//! Deltas are best-effort: the worker drops them rather than wait, and the broker drops
//! them when the requester has gone. The ledger's result stays the truth, so a reader
//! ([`StreamText`]) forwards deltas only while they arrive in order and, once the outcome
//! is known, completes the text from the ledger's result — or reports that what it
//! already sent is not a prefix of it.

use serde::{Deserialize, Serialize};

/// The schema version of a delta body.
pub const DELTA_VERSION: u32 = 1;

/// RabbitMQ's direct reply-to pseudo-queue, the only `reply_to` lastcall's producers set.
pub const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// Whether a delivered `reply_to` may receive token deltas: only a RabbitMQ direct
/// reply-to address (`amq.rabbitmq.reply-to`, or the `amq.rabbitmq.reply-to.<channel
/// token>` the broker hands the consumer), which reaches nothing but the channel that
/// published the job. `reply_to` is outside the signed bytes, so any other name — a
/// queue of the topology such as `{prefix}.work`, reached through the default exchange —
/// gets no deltas.
pub fn is_direct_reply_to(reply_to: &str) -> bool {
    reply_to == DIRECT_REPLY_TO
        || reply_to
            .strip_prefix(DIRECT_REPLY_TO)
            .and_then(|rest| rest.strip_prefix('.'))
            .is_some_and(|token| !token.is_empty())
}

/// One piece of a model call's text, or the end of a call's pieces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    /// Always [`DELTA_VERSION`].
    pub v: u32,
    pub job_id: String,
    /// The attempt (0-based) whose call produced it.
    pub attempt: u32,
    /// 0, 1, 2, … per attempt; a gap means a delta was lost.
    pub seq: u64,
    /// The text to append (empty in the end marker).
    pub text: String,
    /// The call ended (whatever its outcome): no more deltas of this attempt follow.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub end: bool,
}

impl Delta {
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parse a body; `None` for anything that is not a v1 delta.
    pub fn from_json(body: &[u8]) -> Option<Self> {
        serde_json::from_slice::<Self>(body)
            .ok()
            .filter(|d| d.v == DELTA_VERSION)
    }
}

/// What a streaming reader has forwarded so far, and which deltas it still takes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamText {
    /// The text forwarded so far.
    pub sent: String,
    /// The attempt whose deltas are being forwarded (the first one seen).
    attempt: Option<u32>,
    next_seq: u64,
    /// A delta was missed, or another attempt's arrived after text was sent: nothing more
    /// is forwarded from deltas; the rest comes from the ledger.
    stalled: bool,
    /// The followed attempt's end marker was seen: every delta it sent has arrived.
    pub ended: bool,
}

/// The text already sent is not a prefix of the ledger's result (a retried call produced
/// other text after streaming began).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diverged;

impl StreamText {
    pub fn new() -> Self {
        Self::default()
    }

    /// Take one delta; the text to forward now (`None`: nothing to forward).
    pub fn on_delta(&mut self, d: &Delta) -> Option<String> {
        if self.stalled {
            return None;
        }
        match self.attempt {
            Some(a) if a == d.attempt => {}
            // Nothing sent yet: a later attempt (a retry) may take over from the start.
            _ if self.sent.is_empty() && d.seq == 0 => {
                self.attempt = Some(d.attempt);
                self.next_seq = 0;
                self.ended = false;
            }
            _ => {
                self.stalled = true;
                return None;
            }
        }
        if d.seq != self.next_seq {
            self.stalled = true;
            return None;
        }
        self.next_seq += 1;
        if d.end {
            self.ended = true;
        }
        if d.text.is_empty() {
            return None;
        }
        self.sent.push_str(&d.text);
        Some(d.text.clone())
    }

    /// Whether more deltas could still be forwarded.
    pub fn is_live(&self) -> bool {
        !self.stalled && !self.ended
    }

    /// The job completed with `result`: the rest of it to send after what was sent.
    pub fn finish<'a>(&self, result: &'a str) -> Result<&'a str, Diverged> {
        result.strip_prefix(self.sent.as_str()).ok_or(Diverged)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn only_direct_reply_to_addresses_take_deltas() {
        assert!(is_direct_reply_to("amq.rabbitmq.reply-to"));
        assert!(is_direct_reply_to(
            "amq.rabbitmq.reply-to.g1h2AA5yZXBseUAzMjQ2MAAAAC4AAAAAZ2ZkZA=="
        ));
        for other in [
            "lastcall.work",
            "",
            "amq.rabbitmq.reply-to.",
            "amq.rabbitmq.reply-tox",
            "amq.rabbitmq.reply-to-x",
            "xamq.rabbitmq.reply-to",
            "amq.rabbitmq.reply",
        ] {
            assert!(!is_direct_reply_to(other), "{other:?}");
        }
    }

    use super::*;

    fn d(attempt: u32, seq: u64, text: &str) -> Delta {
        Delta {
            v: 1,
            job_id: "j".into(),
            attempt,
            seq,
            text: text.into(),
            end: false,
        }
    }

    #[test]
    fn in_order_deltas_are_forwarded_and_the_ledger_completes_the_text() {
        let mut s = StreamText::new();
        assert_eq!(s.on_delta(&d(0, 0, "Hel")).as_deref(), Some("Hel"));
        assert_eq!(s.on_delta(&d(0, 1, "lo")).as_deref(), Some("lo"));
        assert_eq!(s.finish("Hello"), Ok(""));
        assert_eq!(s.finish("Hello, world"), Ok(", world"));
        let mut end = d(0, 2, "");
        end.end = true;
        assert_eq!(s.on_delta(&end), None);
        assert!(s.ended && !s.is_live());
    }

    #[test]
    fn a_gap_stalls_and_the_rest_comes_from_the_ledger() {
        let mut s = StreamText::new();
        s.on_delta(&d(0, 0, "a"));
        assert_eq!(s.on_delta(&d(0, 2, "c")), None);
        assert_eq!(s.on_delta(&d(0, 3, "d")), None, "stalled for good");
        assert_eq!(s.finish("abcd"), Ok("bcd"));
    }

    #[test]
    fn a_retry_takes_over_only_before_any_text_was_sent() {
        let mut s = StreamText::new();
        let mut end = d(0, 0, "");
        end.end = true;
        s.on_delta(&end);
        assert_eq!(s.on_delta(&d(1, 0, "x")).as_deref(), Some("x"));
        assert_eq!(s.on_delta(&d(2, 0, "y")), None);
        assert_eq!(s.finish("yz"), Err(Diverged));
        assert_eq!(s.finish("xz"), Ok("z"));
    }

    #[test]
    fn the_body_round_trips_and_other_versions_are_ignored() {
        let mut x = d(3, 7, "é\n\"");
        assert_eq!(Delta::from_json(&x.to_json()), Some(x.clone()));
        assert!(!String::from_utf8(x.to_json()).unwrap().contains("end"));
        x.end = true;
        assert_eq!(Delta::from_json(&x.to_json()), Some(x.clone()));
        x.v = 2;
        assert_eq!(Delta::from_json(&x.to_json()), None);
        assert_eq!(Delta::from_json(b"{}"), None);
    }
}
