//! What may be shown of a secret-bearing or foreign text: URLs with their passwords
//! masked ([`url`]), and a backend's failure as its class, without the upstream server's
//! words ([`backend_failure`]).

/// The mask that replaces a password.
pub const MASK: &str = "***";

/// Mask the passwords of a URL, or of each URL of a comma-separated list (a cluster's
/// nodes): the password of `user:password@` and the value of every query parameter whose
/// name says it is a secret (`password`, `sslpassword`, `passwd`, `pwd`, `token`,
/// `secret`, `…key`, not the `…file` that holds one). Anything else is kept as it is.
///
/// The authority ends at the first `/`, `?` or `#` (RFC 3986): a password must be
/// percent-encoded, as every client requires.
pub fn url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, one) in urls(text).into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&one_url(one));
    }
    out
}

/// Split at the commas that start another URL (`,scheme://`); a comma elsewhere (in a
/// password, a query) stays inside its URL.
fn urls(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (i, _) in text.match_indices(',') {
        let next = &text[i + 1..];
        let scheme_len = next
            .find(|c: char| !(c.is_ascii_alphanumeric() || "+-.".contains(c)))
            .unwrap_or(next.len());
        if scheme_len > 0 && next[scheme_len..].starts_with("://") {
            parts.push(&text[start..i]);
            start = i + 1;
        }
    }
    parts.push(&text[start..]);
    parts
}

fn one_url(v: &str) -> String {
    let (head, rest) = match v.find("://") {
        Some(s) => (&v[..s + 3], &v[s + 3..]),
        None => ("", v),
    };
    let mut out = head.to_owned();
    let tail = if head.is_empty() {
        // Not a URL: only `key=value` parameters after a `?` are looked at.
        rest
    } else {
        let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let authority = &rest[..auth_end];
        match authority.rfind('@') {
            Some(at) => {
                let creds = &authority[..at];
                match creds.find(':') {
                    Some(c) => {
                        out.push_str(&creds[..c]);
                        out.push(':');
                        out.push_str(MASK);
                    }
                    None => out.push_str(creds),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        &rest[auth_end..]
    };
    match tail.find('?') {
        Some(q) => {
            out.push_str(&tail[..=q]);
            let (query, fragment) = match tail[q + 1..].find('#') {
                Some(h) => (&tail[q + 1..q + 1 + h], &tail[q + 1 + h..]),
                None => (&tail[q + 1..], ""),
            };
            let mut params = query;
            loop {
                let end = params.find(['&', ';']).unwrap_or(params.len());
                let p = &params[..end];
                match p.split_once('=') {
                    Some((k, _)) if secret_param(k) => {
                        out.push_str(k);
                        out.push('=');
                        out.push_str(MASK);
                    }
                    _ => out.push_str(p),
                }
                if end == params.len() {
                    break;
                }
                // The separator as it was.
                out.push_str(&params[end..=end]);
                params = &params[end + 1..];
            }
            out.push_str(fragment);
        }
        None => out.push_str(tail),
    }
    out
}

/// Whether a query parameter holds a secret by its name (case-insensitive,
/// percent-decoding not needed for the usual names).
fn secret_param(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "password", "passwd", "pwd", "pass", "token", "secret", "key",
    ]
    .iter()
    .any(|w| n.contains(w))
        && !n.ends_with("file")
}

/// What a tenant reads of a failed model call (a job's `error`): its class from the
/// backend's stable reason code (`http_502` → "upstream returned HTTP 502"), never the
/// upstream server's text, which can name internal hosts and URLs (that goes to the
/// worker's log). `message` is used only for the failures that are about the job's own
/// payload, whose text the backend wrote itself.
pub fn backend_failure(reason: &str, message: &str) -> String {
    if let Some(status) = reason
        .strip_prefix("http_")
        .filter(|s| s.len() == 3 && s.bytes().all(|b| b.is_ascii_digit()))
    {
        return format!("upstream returned HTTP {status}");
    }
    let text = match reason {
        "bad_payload" | "invalid_payload" | "prompt_too_long" => {
            return format!("the payload cannot be sent to the model: {message}");
        }
        "connect_error" => "could not connect to the upstream",
        "timeout" => "the upstream did not answer in time",
        "http_error" => "the request to the upstream failed",
        "stream_broken" => "the connection to the upstream broke during the answer",
        "stream_error" => "the upstream reported an error during the answer",
        "bad_stream" => "the upstream sent an answer that could not be read",
        "stream_truncated" | "stream_incomplete" => "the upstream's answer ended early",
        "no_route" => "no backend serves this kind of job",
        "local_pool_busy" => "every local model instance was busy",
        "local_model_error" | "local_panic" => "the local model failed",
        _ => "",
    };
    if text.is_empty() {
        // Another code (a simulated fault, a later backend): the code itself, which is
        // ours, kept to identifier characters.
        let code: String = reason
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
            .take(64)
            .collect();
        format!("the model call failed ({code})")
    } else {
        text.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn passwords_in_the_authority_and_the_query_are_masked() {
        assert_eq!(
            url("amqp://guest:secret@h:5672/%2f"),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(url("amqp://h:5672"), "amqp://h:5672");
        assert_eq!(
            url("amqp://a:p1@h1:5672,amqp://b:p2@h2:5672"),
            "amqp://a:***@h1:5672,amqp://b:***@h2:5672"
        );
        assert_eq!(
            url("postgres://u@db/x?sslmode=require&password=hunter2"),
            "postgres://u@db/x?sslmode=require&password=***"
        );
        assert_eq!(
            url("postgresql://u:pw@db:5432/x?sslpassword=k3y&application_name=a#f"),
            "postgresql://u:***@db:5432/x?sslpassword=***&application_name=a#f"
        );
        assert_eq!(
            url("postgres:///x?host=/run/pg&user=u&PassWord=p"),
            "postgres:///x?host=/run/pg&user=u&PassWord=***"
        );
        assert_eq!(
            url("amqps://h/%2f?cacertfile=/ca.pem&keyfile=/k.pem"),
            "amqps://h/%2f?cacertfile=/ca.pem&keyfile=/k.pem"
        );
        assert_eq!(url("sqlite://lastcall.db"), "sqlite://lastcall.db");
        assert_eq!(url("sqlite://l.db?mode=rwc"), "sqlite://l.db?mode=rwc");
        // An '@' in the path is not a password.
        assert_eq!(url("http://h:15672/a@b"), "http://h:15672/a@b");
        // A comma inside a password does not split the list.
        assert_eq!(url("amqp://u:a,b@h/v"), "amqp://u:***@h/v");
    }

    #[test]
    fn backend_failures_are_shown_as_their_class() {
        assert_eq!(
            backend_failure(
                "http_502",
                "<html>bad gateway at http://10.0.0.7:8000</html>"
            ),
            "upstream returned HTTP 502"
        );
        assert_eq!(
            backend_failure(
                "connect_error",
                "error sending request for url (http://10.0.0.7/v1)"
            ),
            "could not connect to the upstream"
        );
        assert_eq!(
            backend_failure("bad_payload", "`messages` must be an array"),
            "the payload cannot be sent to the model: `messages` must be an array"
        );
        assert_eq!(
            backend_failure("sim_503", "simulated overload"),
            "the model call failed (sim_503)"
        );
        assert_eq!(
            backend_failure("x\ny http://h", "m"),
            "the model call failed (xyhttph)"
        );
    }

    proptest! {
        /// No password of a URL or of a secret parameter survives, whatever its
        /// characters (those a URL carries unencoded), and the host stays readable.
        #[test]
        fn no_password_survives(
            user in "[a-z]{1,8}",
            pass in "[A-Za-z0-9._~!$'()*+,%-]{1,24}",
            qpass in "[A-Za-z0-9._~%-]{1,24}",
            param in prop::sample::select(vec!["password", "sslpassword", "Passwd", "token", "api_key"]),
            list in any::<bool>(),
        ) {
            let (pass, qpass) = (format!("S3CR{pass}"), format!("Q5CR{qpass}"));
            let one = format!("postgres://{user}:{pass}@db.internal:5432/x?sslmode=require&{param}={qpass}");
            let text = if list { format!("amqp://{user}:{pass}@h1:5672,{one}") } else { one };
            let shown = url(&text);
            prop_assert!(!shown.contains(&pass), "{shown}");
            prop_assert!(!shown.contains(&qpass), "{shown}");
            prop_assert!(shown.contains("db.internal:5432"), "{shown}");
        }
    }
}
