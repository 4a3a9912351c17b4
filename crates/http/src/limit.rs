//! A bound on the connections a server holds at once: [`Limited`] wraps a listener and
//! accepts the next connection only when one of `max` permits is free; a connection gives
//! its permit back when it closes. Connections beyond the bound wait in the kernel's
//! accept backlog (and past it are refused by the kernel), so an idle or slow client
//! opening sockets cannot exhaust the process's file descriptors and tasks.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections one server holds at once by default (`serve --max-connections`).
pub const MAX_CONNECTIONS: usize = 8_192;

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
