//! A minimal server-sent-events decoder: bytes in, the `data` of each event out.
//!
//! Enough of the SSE format for chat-completion streams: lines end in `\n`, `\r\n` or `\r`;
//! `data:` lines of one event are joined with `\n`; a blank line ends the event; comments
//! (`:` lines, which some servers send as keep-alive pings) and other fields (`event:`,
//! `id:`, `retry:`) are skipped. Pure and incremental: chunks may split lines anywhere,
//! even inside a UTF-8 character.

/// Incremental decoder state.
#[derive(Debug, Default)]
pub struct SseDecoder {
    /// Bytes of the line not finished yet.
    line: Vec<u8>,
    /// `data` of the event being read, if it has any `data:` line yet.
    data: Option<String>,
    /// The previous chunk ended in `\r`: a `\n` starting the next one belongs to it.
    after_cr: bool,
}

/// Longest line kept; a server that sends more without a newline is broken.
const MAX_LINE: usize = 4 * 1024 * 1024;

/// The stream is not SSE (a line longer than [`MAX_LINE`]).
#[derive(Debug, PartialEq, Eq)]
pub struct LineTooLong;

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one chunk; returns the `data` of every event it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<String>, LineTooLong> {
        let mut events = Vec::new();
        for &b in chunk {
            let after_cr = std::mem::take(&mut self.after_cr);
            match b {
                b'\n' if after_cr => {}
                b'\n' | b'\r' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(data) = self.line_done(&line) {
                        events.push(data);
                    }
                }
                _ => {
                    if self.line.len() >= MAX_LINE {
                        return Err(LineTooLong);
                    }
                    self.line.push(b);
                }
            }
        }
        Ok(events)
    }

    /// The `data` of an event the stream ended in without its blank line, if any.
    pub fn finish(&mut self) -> Option<String> {
        let line = std::mem::take(&mut self.line);
        let from_line = self.line_done(&line);
        from_line.or_else(|| self.data.take())
    }

    fn line_done(&mut self, line: &[u8]) -> Option<String> {
        if line.is_empty() {
            return self.data.take();
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_ref(), ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_in_pieces(input: &[u8], piece: usize) -> Vec<String> {
        let mut d = SseDecoder::new();
        let mut out = Vec::new();
        for c in input.chunks(piece) {
            out.extend(d.push(c).unwrap());
        }
        out.extend(d.finish());
        out
    }

    #[test]
    fn events_survive_any_split_and_any_line_ending() {
        let input = ": ping\r\n\r\ndata: {\"a\":\"é\"}\r\n\r\nevent: x\ndata:b1\ndata: b2\n\ndata: [DONE]\r\r";
        let want = vec![
            "{\"a\":\"é\"}".to_string(),
            "b1\nb2".into(),
            "[DONE]".into(),
        ];
        for piece in 1..=input.len() {
            assert_eq!(
                decode_in_pieces(input.as_bytes(), piece),
                want,
                "piece {piece}"
            );
        }
    }

    #[test]
    fn an_unterminated_last_event_is_returned_by_finish() {
        assert_eq!(decode_in_pieces(b"data: x", 3), vec!["x".to_string()]);
        assert_eq!(decode_in_pieces(b"data: x\n", 3), vec!["x".to_string()]);
        assert!(decode_in_pieces(b": only a comment", 4).is_empty());
    }
}
