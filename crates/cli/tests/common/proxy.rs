//! Fault injection on a real broker connection: a loopback TCP proxy in front of RabbitMQ
//! that can be *frozen* — bytes from the broker to the client are held (not dropped) until
//! it thaws, while the client's bytes still reach the broker. A publisher behind a frozen
//! proxy publishes for real but never sees the confirm in time. It can also delay every
//! chunk both ways ([`delay`](FreezableProxy::delay)) or blackhole the traffic both ways
//! ([`blackhole`](FreezableProxy::blackhole): held, neither side hears from the other).

use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct FreezableProxy {
    /// Where clients connect (`amqp://guest:guest@{addr}/%2f`).
    pub addr: SocketAddr,
    frozen: watch::Sender<bool>,
    /// Holds the client's bytes too (with `frozen`: a blackhole).
    frozen_up: watch::Sender<bool>,
    /// Added to every chunk, both directions, in ms.
    delay_ms: watch::Sender<u64>,
    /// Bumped by [`reset`](Self::reset): every connection open then is cut.
    resets: watch::Sender<u64>,
    /// While set, new connections are accepted and closed at once (a dead node).
    refusing: watch::Sender<bool>,
    /// Connections closed at once while refusing.
    refused: std::sync::Arc<std::sync::atomic::AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl FreezableProxy {
    /// Listen on a free loopback port and forward every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (frozen, gate) = watch::channel(false);
        let (frozen_up, gate_up) = watch::channel(false);
        let (delay_ms, delay) = watch::channel(0u64);
        let (resets, reset_rx) = watch::channel(0u64);
        let (refusing, refusing_rx) = watch::channel(false);
        let refused = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let refused_count = refused.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *refusing_rx.borrow() {
                    drop(client);
                    refused_count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (client_rx, client_tx) = client.into_split();
                let (server_rx, server_tx) = server.into_split();
                let mut cut = reset_rx.clone();
                cut.mark_unchanged();
                let mut cut2 = cut.clone();
                let (up, d1) = (gate_up.clone(), delay.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = pump(client_rx, server_tx, up, d1) => {}
                        _ = cut.changed() => {}
                    }
                });
                let (gate, d2) = (gate.clone(), delay.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = pump(server_rx, client_tx, gate, d2) => {}
                        _ = cut2.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            frozen,
            frozen_up,
            delay_ms,
            resets,
            refusing,
            refused,
            accept,
        }
    }

    /// Cut every open connection (both directions closed), like a broker restart or a
    /// connection reset seen from the client. New connections are accepted as before.
    #[allow(dead_code)]
    pub fn reset(&self) {
        self.resets.send_modify(|n| *n += 1);
    }

    /// While `on`, accept new connections and close them at once.
    #[allow(dead_code)]
    pub fn refuse(&self, on: bool) {
        self.refusing.send_replace(on);
    }

    /// The connections closed at once while refusing, so far.
    #[allow(dead_code)]
    pub fn refused(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// From now on, hold every byte the broker sends.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Deliver the held bytes and forward normally again.
    pub fn thaw(&self) {
        self.frozen.send_replace(false);
        self.frozen_up.send_replace(false);
    }

    /// Hold every byte both ways (a network partition that drops nothing visibly: no
    /// reset, no refusal, just silence) until [`thaw`](Self::thaw).
    #[allow(dead_code)]
    pub fn blackhole(&self) {
        self.frozen_up.send_replace(true);
        self.frozen.send_replace(true);
    }

    /// Delay every chunk, both directions, by `ms` (0: no delay).
    #[allow(dead_code)]
    pub fn delay(&self, ms: u64) {
        self.delay_ms.send_replace(ms);
    }
}

impl Drop for FreezableProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copy `from` to `to`; each chunk waits while the gate says frozen, then the delay.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut gate: watch::Receiver<bool>,
    delay: watch::Receiver<u64>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if gate.wait_for(|frozen| !*frozen).await.is_err() {
            break;
        }
        let ms = *delay.borrow();
        if ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
