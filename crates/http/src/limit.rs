//! What one client may hold of a server ([`Limits`]), and the serving loop that keeps
//! them ([`serve`]):
//! - a bound on the connections held at once: [`Limited`] wraps a listener and accepts the
//!   next connection only when one of `max` permits is free; a connection gives its permit
//!   back when it closes. Connections beyond the bound wait in the kernel's accept backlog
//!   (and past it are refused by the kernel), so an idle or slow client opening sockets
//!   cannot exhaust the process's file descriptors and tasks;
//! - a header-read timeout: a request's headers must arrive within it, or the connection
//!   is closed (slowloris). `axum::serve` gives hyper no timer, so hyper's own 30 s
//!   default never fires; [`serve`] drives each connection with hyper's http1 builder, a
//!   Tokio timer and the timeout. A long-poll or a stream is not affected: the timeout
//!   covers reading headers only.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections one server holds at once by default (`serve --max-connections`).
pub const MAX_CONNECTIONS: usize = 8_192;

/// How long a request's headers may take to arrive by default (`serve
/// --header-read-timeout-ms`).
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// What one server allows its clients.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections held at once.
    pub max_connections: usize,
    /// How long a request's headers may take to arrive.
    pub header_read_timeout: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
        }
    }
}

/// Serve `router` on `listener` within `limits` until `stop` fires; then stop accepting,
/// let every open connection finish its request in flight (hyper's graceful shutdown) and
/// return once all have closed.
pub async fn serve<L>(
    listener: L,
    router: axum::Router,
    stop: tokio_util::sync::CancellationToken,
    limits: Limits,
) -> std::io::Result<()>
where
    L: axum::serve::Listener,
{
    let mut listener = Limited::new(listener, limits.max_connections);
    // Each connection task holds a sender; all dropped: every connection has closed.
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    loop {
        let (io, _peer) = tokio::select! {
            conn = axum::serve::Listener::accept(&mut listener) => conn,
            () = stop.cancelled() => break,
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
        let (stop, open) = (stop.clone(), open.clone());
        tokio::spawn(async move {
            let _open = open;
            let mut conn = std::pin::pin!(conn.with_upgrades());
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "HTTP connection ended with an error");
                    }
                }
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    drop(open);
    let _ = all_closed.recv().await;
    Ok(())
}

/// A listener that holds at most `max` connections at once.
pub struct Limited<L> {
    inner: L,
    permits: Arc<Semaphore>,
}

impl<L> Limited<L> {
    pub fn new(inner: L, max: usize) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max.max(1))),
        }
    }
}

impl<L> axum::serve::Listener for Limited<L>
where
    L: axum::serve::Listener,
{
    type Io = Permitted<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let permit = match self.permits.clone().acquire_owned().await {
            Ok(p) => p,
            // The semaphore is never closed.
            Err(_) => std::future::pending().await,
        };
        let (io, addr) = self.inner.accept().await;
        (
            Permitted {
                io,
                _permit: permit,
            },
            addr,
        )
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection and its permit, given back when the connection is dropped.
pub struct Permitted<T> {
    io: T,
    _permit: OwnedSemaphorePermit,
}

impl<T: AsyncRead + Unpin> AsyncRead for Permitted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Permitted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
