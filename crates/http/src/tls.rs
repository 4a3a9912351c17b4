//! HTTPS for `lastcall serve --tls-cert --tls-key`: the same router behind a rustls
//! acceptor (tokio-rustls, aws-lc-rs: the TLS stack the clients already build).
//!
//! [`crate::listen`] with a [`TlsServerConfig`] serves over an [`axum::serve::Listener`]
//! that hands axum only finished handshakes. Handshakes run in their own tasks (a slow or
//! silent client holds up nobody), at most [`MAX_HANDSHAKES`] at once, each bounded by
//! [`HANDSHAKE_TIMEOUT`]; a failed one is logged at debug and dropped.

use axum::Router;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// How long a client may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; further connections wait in the kernel's backlog.
pub const MAX_HANDSHAKES: usize = 256;

/// The server side of TLS: a certificate chain and its key, both PEM.
#[derive(Clone)]
pub struct TlsServerConfig(Arc<ServerConfig>);

impl std::fmt::Debug for TlsServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServerConfig").finish_non_exhaustive()
    }
}

impl TlsServerConfig {
    /// Read `cert` (the server certificate first, then any intermediates) and `key` (PKCS#8,
    /// PKCS#1 or SEC1). The error names the file and what is wrong with it.
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<Self, String> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .map_err(|e| format!("cannot read the TLS certificate {}: {e}", cert.display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("invalid PEM in the TLS certificate {}: {e}", cert.display()))?;
        if chain.is_empty() {
            return Err(format!(
                "no certificate in {} (expected PEM: -----BEGIN CERTIFICATE-----)",
                cert.display()
            ));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| format!("cannot read a private key from {}: {e}", key.display()))?;
        let provider = Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| format!("the TLS key does not fit the certificate: {e}"))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self(Arc::new(config)))
    }
}

/// Serve `router` over HTTPS on a bound listener until `stop` fires.
pub(crate) async fn serve_tls_on(
    tcp: TcpListener,
    router: Router,
    stop: CancellationToken,
    tls: TlsServerConfig,
    limits: crate::limit::Limits,
) -> std::io::Result<()> {
    let local = tcp.local_addr()?;
    tracing::info!(addr = %local, "HTTPS listening");
    let listener = TlsListener::spawn(tcp, TlsAcceptor::from(tls.0), local);
    crate::limit::serve(listener, router, stop, limits).await
}

/// Finished handshakes, from a task that accepts TCP connections.
struct TlsListener {
    done: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept_task: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    fn spawn(mut tcp: TcpListener, acceptor: TlsAcceptor, local: SocketAddr) -> Self {
        let (tx, done) = tokio::sync::mpsc::channel(64);
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let accept_task = tokio::spawn(async move {
            loop {
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    return;
                };
                // axum's own accept: retries (and backs off on EMFILE) by itself.
                let (stream, peer) = axum::serve::Listener::accept(&mut tcp).await;
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Self {
            done,
            local,
            accept_task,
        }
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.done.recv().await {
            Some(conn) => conn,
            // The accept task only ends when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
