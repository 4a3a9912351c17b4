//! TLS end to end (#14.7), against services this test starts itself with a CA it generates
//! (`openssl` CLI), never the shared broker or database:
//! - `amqps://` to a private RabbitMQ node whose only listener is TLS: refused without the CA
//!   (`cacertfile`), a job through the real worker with it, a client certificate;
//! - the ledger on a private PostgreSQL cluster that accepts TLS connections only:
//!   `sslmode=verify-full&sslrootcert=…` writes and reads, without the CA it is refused, and
//!   `sslmode=require` fails against the same server with TLS off;
//! - `lastcall serve --tls-cert --tls-key` and `lastcall worker` (the real binary) over
//!   amqps and PostgreSQL TLS: a job POSTed over HTTPS (reqwest trusting the CA) completes.

use crate::common;

use common::http::Children;
use common::private_pg::PrivatePg;
use common::private_rabbit::{PrivateRabbit, free_port};
use common::{OutputBounded, job, sim, system_clock, unique};
use lastcall_broker::{Broker, Publisher, Topology};
use lastcall_core::{AdmissionPolicy, EnvelopeLimits};
use lastcall_store::{AcceptedJob, Ledger};
use lastcall_worker::clock::now_ms;
use lastcall_worker::{Submitter, Worker, WorkerConfig, WorkerStats};
use sqlx::Connection;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A CA, a server certificate it signed for `localhost` and `127.0.0.1`, and a client
/// certificate; in a directory removed on drop.
struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(unique(&format!("tls-{name}")));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = Self { dir };
        ca.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=lastcall test CA",
        ]);
        ca.issue(
            "server",
            "/CN=localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        );
        ca.issue(
            "client",
            "/CN=lastcall-test-client",
            "extendedKeyUsage=clientAuth\n",
        );
        ca
    }

    fn issue(&self, name: &str, subject: &str, ext: &str) {
        let ext_file = format!("{name}.ext");
        std::fs::write(
            self.dir.join(&ext_file),
            format!("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n{ext}"),
        )
        .unwrap();
        let (key, csr, pem) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &pem,
            "-extfile",
            &ext_file,
        ]);
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .expect("the openssl CLI");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rabbit_tls(ca: &TestCa) -> PrivateRabbit {
    PrivateRabbit::start_tls(
        &ca.path("ca.pem"),
        &ca.path("server.pem"),
        &ca.path("server.key"),
    )
}

/// A private cluster with `ssl = on` (the CA's server certificate) whose pg_hba.conf
/// rejects every TCP connection without TLS.
fn pg_tls(ca: &TestCa) -> PrivatePg {
    let mut pg = PrivatePg::init();
    let cert = pg.install(&ca.path("server.pem"), "server.crt");
    let key = pg.install(&ca.path("server.key"), "server.key");
    pg.set("ssl", "on");
    pg.set("ssl_cert_file", cert.to_str().unwrap());
    pg.set("ssl_key_file", key.to_str().unwrap());
    write_hba(
        &pg,
        "hostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n",
    );
    pg.ctl_start();
    pg.create_db();
    pg
}

fn write_hba(pg: &PrivatePg, tcp_rules: &str) {
    // Overwriting keeps the file's owner (postgres).
    std::fs::write(
        pg.data().join("pg_hba.conf"),
        format!("local all all trust\n{tcp_rules}"),
    )
    .unwrap();
}

fn verify_full(pg: &PrivatePg, ca: &TestCa) -> String {
    format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        pg.url(),
        ca.path("ca.pem").display()
    )
}

/// Whether every client connection to the database `lastcall` uses TLS, and how many there
/// are (including the one asking).
async fn pg_client_connections(url: &str) -> (bool, i64) {
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    let row: (Option<bool>, i64) = sqlx::query_as(
        "SELECT bool_and(s.ssl), count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.datname = 'lastcall' AND a.backend_type = 'client backend'",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    (row.0.unwrap_or(false), row.1)
}

/// `rabbitmqctl list_connections ssl peer_cert_subject`, one `(ssl, subject)` per connection.
fn rabbit_connections(rabbit: &PrivateRabbit) -> Vec<(String, String)> {
    let out = rabbit.ctl(&[
        "list_connections",
        "--quiet",
        "--no-table-headers",
        "ssl",
        "peer_cert_subject",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (ssl, subject) = l.split_once('\t').unwrap_or((l, ""));
            (ssl.trim().to_owned(), subject.trim().to_owned())
        })
        .collect()
}

async fn wait_for<F: std::future::Future<Output = bool>>(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> F,
) {
    let until = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_a_private_ca_runs_a_job_through_the_worker() {
    let ca = TestCa::new("amqps");
    let rabbit = rabbit_tls(&ca);
    let base = format!("amqps://guest:guest@127.0.0.1:{}/%2f", rabbit.port);

    // The platform's roots do not know the test CA: the handshake fails, nothing connects.
    let e = Broker::connect(&base).await.unwrap_err().to_string();
    assert!(e.contains("UnknownIssuer"), "{e}");
    assert!(!e.contains("guest:guest"), "password in the error: {e}");
    // TLS settings on a plain URL are a usage error, not a silent plaintext connection.
    let e = Broker::connect(&format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f?cacertfile={}",
        rabbit.port,
        ca.path("ca.pem").display()
    ))
    .await
    .unwrap_err();
    assert!(matches!(e, lastcall_broker::BrokerError::Url { .. }), "{e}");

    let url = format!("{base}?cacertfile={}", ca.path("ca.pem").display());
    let prefix = unique("amqps");
    let broker = Broker::connect(&url).await.unwrap();
    let mut topo = Topology::new(&prefix);
    topo.retry_delays_ms = vec![1_000, 5_000];
    topo.apply(&broker).await.unwrap();
    let ledger = Arc::new(
        Ledger::connect(&format!("sqlite://{}", ca.path("ledger.db").display()))
            .await
            .unwrap(),
    );
    let mut cfg = WorkerConfig::new(&prefix, 2);
    cfg.topology = topo.clone();
    cfg.name = "tls-worker".into();
    cfg.shutdown_grace = Duration::from_secs(3);
    let stats = Arc::new(WorkerStats::default());
    let sim = sim(20);
    let worker = Worker::build(
        cfg,
        Broker::connect(&url).await.unwrap(),
        ledger.clone(),
        sim.clone(),
        system_clock(),
        stats.clone(),
    )
    .await
    .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await.unwrap() }
    });
    let submitter = Submitter::new(
        Publisher::new(&broker, Duration::from_secs(5))
            .await
            .unwrap(),
        topo.names.clone(),
        Some(ledger.clone()),
        AdmissionPolicy {
            clock_uncertainty_ms: 100,
            default_min_runtime_ms: 0,
        },
        EnvelopeLimits::default(),
    );
    let ids: Vec<String> = (0..5).map(|i| format!("amqps-{i}")).collect();
    for id in &ids {
        submitter.submit(&job(id, 60_000), now_ms()).await.unwrap();
    }
    for id in &ids {
        let ledger = ledger.clone();
        wait_for(&format!("{id} completed"), Duration::from_secs(30), || {
            let ledger = ledger.clone();
            let id = id.clone();
            async move {
                ledger
                    .get(&id)
                    .await
                    .unwrap()
                    .is_some_and(|r| r.state == "completed")
            }
        })
        .await;
        assert_eq!(sim.calls_for(id), 1, "{id}");
    }
    // A client certificate (certfile + keyfile) is presented and verified by the node.
    let with_cert = format!(
        "{url}&certfile={}&keyfile={}",
        ca.path("client.pem").display(),
        ca.path("client.key").display()
    );
    let mutual = Broker::connect(&with_cert).await.unwrap();
    // Every connection the broker sees (ours, the worker's consumer and publisher, the one
    // with the client certificate) is TLS.
    let conns = rabbit_connections(&rabbit);
    assert!(conns.len() >= 3, "{conns:?}");
    assert!(conns.iter().all(|(ssl, _)| ssl == "true"), "{conns:?}");
    assert!(
        conns
            .iter()
            .any(|(_, subject)| subject.contains("lastcall-test-client")),
        "{conns:?}"
    );
    mutual.close().await;

    stop.cancel();
    running.await.unwrap();
    topo.delete(&broker).await.unwrap();
    broker.close().await;
    ledger.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_on_postgres_over_tls_verifies_the_server() {
    let ca = TestCa::new("pg");
    let mut pg = pg_tls(&ca);
    let url = verify_full(&pg, &ca);

    let ledger = Ledger::connect(&url).await.unwrap();
    let now = now_ms();
    let accepted = AcceptedJob {
        job_id: "pg-tls-1".into(),
        kind: "incident.summary".into(),
        created_at_ms: now,
        expires_at_ms: now + 60_000,
        accepted_at_ms: now,
        trace_id: None,
        payload_hash: "h".into(),
        tenant: lastcall_core::Tenant::default_tenant(),
        priority: lastcall_core::Priority::Standard,
    };
    assert!(ledger.record_accepted(&accepted).await.unwrap());
    let rec = ledger.get("pg-tls-1").await.unwrap().unwrap();
    assert_eq!(rec.state, "accepted");
    // The server says so: every client connection (the ledger's and this check's) is TLS.
    let (all_tls, n) = pg_client_connections(&url).await;
    assert!(all_tls && n >= 2, "tls {all_tls}, {n} connections");
    ledger.close().await;

    // Without the CA the server's certificate is not trusted (webpki roots only).
    let e = Ledger::connect(&format!("{}?sslmode=verify-full", pg.url()))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("UnknownIssuer"), "{e}");
    // Without TLS this server refuses the connection (pg_hba.conf: hostnossl reject).
    let e = Ledger::connect(&format!("{}?sslmode=disable", pg.url()))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no encryption"), "{e}");

    // The same server with TLS off: sslmode=require refuses to go on in plaintext, the
    // default (prefer) falls back to it.
    pg.stop_immediate();
    pg.set("ssl", "off");
    write_hba(&pg, "host all all 127.0.0.1/32 trust\n");
    pg.ctl_start();
    let e = Ledger::connect(&format!("{}?sslmode=require", pg.url()))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.to_lowercase().contains("tls") || e.contains("SSL"), "{e}");
    let e = Ledger::connect(&url).await.unwrap_err().to_string();
    assert!(e.to_lowercase().contains("tls") || e.contains("SSL"), "{e}");
    let plain = Ledger::connect(&pg.url()).await.unwrap();
    assert!(plain.get("pg-tls-1").await.unwrap().is_some());
    plain.close().await;
}

const TOKEN: &str = "tls-test-token-0123456789abcdef";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_over_https_with_the_worker_over_amqps_and_postgres_tls() {
    let ca = TestCa::new("e2e");
    let rabbit = rabbit_tls(&ca);
    let pg = pg_tls(&ca);
    let amqp = format!(
        "amqps://guest:guest@127.0.0.1:{}/%2f?cacertfile={}",
        rabbit.port,
        ca.path("ca.pem").display()
    );
    let store = verify_full(&pg, &ca);
    let prefix = unique("https");
    let port = free_port();
    let lastcall = |args: &[&str], log: &str| {
        let log = std::fs::File::create(ca.path(log)).unwrap();
        Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args([
                "--amqp-url",
                &amqp,
                "--store-url",
                &store,
                "--prefix",
                &prefix,
            ])
            .args(args)
            .env("LASTCALL_HTTP_TOKEN", TOKEN)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap()
    };
    let addr = format!("127.0.0.1:{port}");
    let cert = ca.path("server.pem");
    let key = ca.path("server.key");

    // Refusals, each a one-line startup error: a broker certificate from an unknown CA (the
    // URL without cacertfile), a --tls-cert holding no certificate, a lone --tls-cert.
    let refused = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args(["--store-url", &store, "--prefix", &prefix])
            .args(args)
            .env("LASTCALL_HTTP_TOKEN", TOKEN)
            .output_bounded()
            .unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let no_ca = amqp.split('?').next().unwrap();
    let e = refused(&[
        "--amqp-url",
        no_ca,
        "serve",
        "--addr",
        &addr,
        "--no-management",
        "--connect-timeout-ms",
        "1000",
    ]);
    assert!(
        e.contains("TLS: invalid peer certificate: UnknownIssuer") && e.contains("cacertfile="),
        "{e}"
    );
    assert!(!e.contains("guest:guest"), "{e}");
    let e = refused(&[
        "--amqp-url",
        &amqp,
        "serve",
        "--tls-cert",
        ca.path("ca.key").to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    assert!(e.contains("no certificate in"), "{e}");
    let e = refused(&[
        "--amqp-url",
        &amqp,
        "serve",
        "--tls-cert",
        cert.to_str().unwrap(),
    ]);
    assert!(e.contains("--tls-key"), "{e}");
    let mut children = Children(vec![lastcall(
        &[
            "serve",
            "--addr",
            &addr,
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--no-management",
            "--retry-delays-ms",
            "1000,5000",
        ],
        "serve.log",
    )]);
    let ca_cert =
        reqwest::Certificate::from_pem(&std::fs::read(ca.path("ca.pem")).unwrap()).unwrap();
    let client = reqwest::Client::builder()
        .tls_certs_only([ca_cert])
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let base = format!("https://127.0.0.1:{port}");
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = client.get(format!("{base}/readyz")).send().await
            && r.status() == 200
        {
            break;
        }
        if let Some(status) = children.0[0].try_wait().unwrap() {
            panic!(
                "serve exited ({status}): {}",
                std::fs::read_to_string(ca.path("serve.log")).unwrap_or_default()
            );
        }
        assert!(Instant::now() < until, "serve did not come up over HTTPS");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    children.0.push(lastcall(
        &[
            "worker",
            "--backend",
            "sim",
            "--sim-latency-ms",
            "20",
            "--retry-delays-ms",
            "1000,5000",
        ],
        "worker.log",
    ));

    // A client that does not trust the CA, and plain HTTP on the HTTPS port, get nothing.
    let untrusting = reqwest::Client::builder().build().unwrap();
    let e = untrusting
        .get(format!("{base}/healthz"))
        .send()
        .await
        .unwrap_err();
    assert!(format!("{e:?}").contains("UnknownIssuer"), "{e:?}");
    let plain = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP answered: {plain:?}");

    let body = r#"{"job_id":"https-1","kind":"incident.summary","deadline_ms":60000,"payload":{"prompt":"summarize"}}"#;
    let r = client
        .post(format!("{base}/v1/jobs"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap_or_default());
    let mut state = String::new();
    let until = Instant::now() + Duration::from_secs(60);
    while state != "completed" {
        for (i, c) in children.0.iter_mut().enumerate() {
            if let Some(status) = c.try_wait().unwrap() {
                let log = if i == 0 { "serve.log" } else { "worker.log" };
                panic!(
                    "{log}: exited ({status}): {}",
                    std::fs::read_to_string(ca.path(log)).unwrap_or_default()
                );
            }
        }
        assert!(
            Instant::now() < until,
            "job not completed (last state {state:?}); worker: {}",
            std::fs::read_to_string(ca.path("worker.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = client
            .get(format!("{base}/v1/jobs/https-1"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            let v: serde_json::Value = r.json().await.unwrap();
            state = v["state"].as_str().unwrap_or_default().to_owned();
        }
    }
    // Both processes reached the broker and the database over TLS only.
    let conns = rabbit_connections(&rabbit);
    assert!(conns.len() >= 2, "{conns:?}");
    assert!(conns.iter().all(|(ssl, _)| ssl == "true"), "{conns:?}");
    let (all_tls, n) = pg_client_connections(&store).await;
    assert!(all_tls && n >= 3, "tls {all_tls}, {n} connections");

    // The topology lives in the private node, which goes with `rabbit`.
    drop(children);
}
