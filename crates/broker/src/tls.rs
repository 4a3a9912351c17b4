//! The broker URL as lapin gets it, and TLS: `amqps://` verifies the broker's certificate
//! against the platform's roots plus, for a private CA, the file named by the URL's
//! `cacertfile` query parameter; `certfile` + `keyfile` present a client certificate. The
//! names are those of RabbitMQ's URI spec (<https://www.rabbitmq.com/docs/uri-query-parameters>);
//! lapin parses none of them itself, it takes them as an `OwnedTLSConfig`.
//!
//! Also: lapin's URI parser reads the host with `Url::domain`, which is `None` for an IP
//! literal, so `amqp://10.0.0.5` would go to `localhost`. [`Target::parse`] puts the IP back.

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};

/// A parsed broker URL: where lapin connects, and with which TLS settings.
#[derive(Debug)]
pub struct Target {
    pub uri: AMQPUri,
    pub tls: OwnedTLSConfig,
    /// The CA file, if the URL named one (for messages).
    pub ca_file: Option<String>,
}

impl Target {
    /// Parse `url` and read the files it names. Errors are one line for a person, without
    /// the password.
    pub fn parse(url: &str) -> Result<Self, String> {
        let parsed = url::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
        let mut uri: AMQPUri = url.parse()?;
        match parsed.host() {
            Some(url::Host::Ipv4(ip)) => uri.authority.host = ip.to_string(),
            Some(url::Host::Ipv6(ip)) => uri.authority.host = ip.to_string(),
            _ => {}
        }
        let param = |name: &str| {
            parsed
                .query_pairs()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.into_owned())
        };
        let ca_file = param("cacertfile");
        let cert_file = param("certfile");
        let key_file = param("keyfile");
        if uri.scheme == AMQPScheme::AMQP {
            if let Some(p) = ["cacertfile", "certfile", "keyfile"]
                .into_iter()
                .find(|p| param(p).is_some())
            {
                return Err(format!(
                    "`{p}` is a TLS setting but the URL is amqp://: use amqps:// (port 5671 by default)"
                ));
            }
            return Ok(Self {
                uri,
                tls: OwnedTLSConfig::default(),
                ca_file,
            });
        }
        if let Some(v) = param("verify")
            && v != "verify_peer"
        {
            return Err(format!(
                "verify={v} is not supported: the broker's certificate is always verified \
                 (name a private CA with cacertfile=/path/ca.pem)"
            ));
        }
        if param("server_name_indication").is_some() {
            return Err(
                "server_name_indication is not supported: the certificate is checked against \
                 the URL's host, so use the host name the certificate names"
                    .into(),
            );
        }
        let cert_chain = match &ca_file {
            Some(path) => {
                let pem = read(path, "cacertfile")?;
                let pem = String::from_utf8(pem)
                    .map_err(|_| format!("cacertfile {path} is not a PEM file"))?;
                if !pem.contains("-----BEGIN CERTIFICATE-----") {
                    return Err(format!("cacertfile {path} holds no PEM certificate"));
                }
                Some(pem)
            }
            None => None,
        };
        let identity = match (&cert_file, &key_file) {
            (Some(cert), Some(key)) => Some(OwnedIdentity::PKCS8 {
                pem: read(cert, "certfile")?,
                key: read(key, "keyfile")?,
            }),
            (None, None) => None,
            _ => return Err("certfile and keyfile go together (a client certificate)".into()),
        };
        Ok(Self {
            uri,
            tls: OwnedTLSConfig {
                identity,
                cert_chain,
            },
            ca_file,
        })
    }
}

fn read(path: &str, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {what} {path}: {e}"))
}

/// Open a connection to one node URL (plain or TLS, as the URL says).
///
/// The node's port is tried with a plain TCP connect first, and lapin is asked only once
/// that succeeds: a lapin connection whose TCP connect fails leaks its internal RPC task
/// and everything that task holds (channel 0, the frame queue, the status; ~6–10 KB per
/// attempt in lapin 4.12: its I/O thread returns early on that error without stopping the
/// task). `serve`'s publisher tries once per request while the broker is down, so a
/// broker restart under load cost it ~1 MB each time (RELIABILITY.md, the soak).
pub(crate) async fn connect(
    url: &str,
    props: ConnectionProperties,
) -> Result<Connection, crate::BrokerError> {
    let target = Target::parse(url).map_err(|message| crate::BrokerError::Url {
        url: crate::redact(url),
        message,
    })?;
    let connect_error = |source| crate::BrokerError::Connect {
        url: crate::redact(url),
        source,
    };
    let runtime = lapin::runtime::default_runtime().map_err(connect_error)?;
    let (host, port) = (target.uri.authority.host.clone(), target.uri.authority.port);
    let handshake = async {
        // Dropped at once: the broker sees a TCP connection closed before the AMQP header.
        drop(
            tokio::net::TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|e| connect_error(e.into()))?,
        );
        Connection::connect_uri_with_config(target.uri, props, target.tls, runtime)
            .await
            .map_err(connect_error)
    };
    match tokio::time::timeout(crate::HANDSHAKE_LIMIT, handshake).await {
        Ok(r) => r,
        Err(_) => Err(crate::BrokerError::HandshakeTimeout {
            url: crate::redact(url),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connect to a port nothing listens on (a broker that is down or restarting) leaves
    /// no task behind: lapin 4.12 leaks its internal RPC task when the TCP connect fails,
    /// so `connect` must not reach lapin then (`serve`'s RSS grew at every broker restart).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_connect_leaves_no_task_behind() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.num_alive_tasks();
        for _ in 0..20 {
            let r = connect(&url, ConnectionProperties::default()).await;
            assert!(
                matches!(r, Err(crate::BrokerError::Connect { .. })),
                "{r:?}"
            );
        }
        // Whatever a failed attempt started may take a moment to end.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while metrics.num_alive_tasks() > before && std::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(
            metrics.num_alive_tasks(),
            before,
            "tasks left alive by 20 refused connects"
        );
    }

    #[test]
    fn an_ip_literal_stays_the_host() {
        let t = Target::parse("amqp://u:p@10.1.2.3:5673/%2f").unwrap();
        assert_eq!(t.uri.authority.host, "10.1.2.3");
        assert_eq!(t.uri.authority.port, 5673);
        let t = Target::parse("amqps://[::1]/v").unwrap();
        assert_eq!(t.uri.authority.host, "::1");
        assert_eq!(t.uri.authority.port, 5671);
        let t = Target::parse("amqp://broker.example:5672/%2f?heartbeat=10").unwrap();
        assert_eq!(t.uri.authority.host, "broker.example");
        assert_eq!(t.uri.query.heartbeat, Some(10));
    }

    #[test]
    fn tls_settings_need_amqps_and_readable_files() {
        let e = Target::parse("amqp://h/%2f?cacertfile=/x/ca.pem").unwrap_err();
        assert!(e.contains("amqps://"), "{e}");
        let e = Target::parse("amqps://h/%2f?cacertfile=/nonexistent/ca.pem").unwrap_err();
        assert!(
            e.contains("cannot read cacertfile /nonexistent/ca.pem"),
            "{e}"
        );
        let e = Target::parse("amqps://h/%2f?certfile=/x/c.pem").unwrap_err();
        assert!(e.contains("go together"), "{e}");
        let e = Target::parse("amqps://h/%2f?verify=verify_none").unwrap_err();
        assert!(e.contains("always verified"), "{e}");
        let not_pem = std::env::temp_dir().join(format!("lastcall-notpem-{}", std::process::id()));
        std::fs::write(&not_pem, "hello").unwrap();
        let e =
            Target::parse(&format!("amqps://h/%2f?cacertfile={}", not_pem.display())).unwrap_err();
        assert!(e.contains("holds no PEM certificate"), "{e}");
        let _ = std::fs::remove_file(&not_pem);
        let t = Target::parse("amqps://h/%2f").unwrap();
        assert_eq!(t.tls, OwnedTLSConfig::default());
        assert_eq!(t.uri.scheme, AMQPScheme::AMQPS);
    }
}
