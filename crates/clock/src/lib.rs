//! The one clock abstraction of lastcall.
//!
//! Deadlines are wall-clock instants set by the ingress, so admission needs this host's
//! wall clock and an allowance for the difference between the two clocks
//! (`--clock-uncertainty-ms`). That allowance is a rule you set from measured clock sync;
//! it is not a measured bound. Where the sync state is unknown, `--clock-sync require`
//! stops admission instead of trusting the constant.
//!
//! A crate of its own because both sides read it: the producer (`lastcall-producer`: the
//! broker TTL is the budget left at the publish) and the worker (`lastcall-worker`, which
//! re-exports it as `lastcall_worker::clock`).
//!
//! Time is also what the worker waits for: a buffered job's latest useful start, a call's
//! deadline, an open breaker's next trial, a rate-limit permit. Those waits go through
//! [`Clock::sleep_until`] on the same clock that told the time, so a test (or a drill) can
//! run a worker on a [`ManualClock`] and move its time forward: the timers fire when the
//! clock says so, not after the real milliseconds have passed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What the host knows about its clock synchronisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncState {
    /// The kernel reports the clock as synchronised; `max_error_ms` is its error estimate.
    Synced { max_error_ms: u64 },
    /// The kernel reports the clock as not synchronised.
    Unsynced,
    /// The state cannot be read on this host.
    Unknown,
}

/// How admission treats the sync state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClockSyncMode {
    /// Admit on the configured uncertainty alone (default).
    #[default]
    Ignore,
    /// Fail closed: admit nothing while the clock is not known to be synchronised.
    Require,
}

impl std::str::FromStr for ClockSyncMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ignore" => Ok(Self::Ignore),
            "require" => Ok(Self::Require),
            _ => Err(format!(
                "unknown clock sync mode `{s}`; expected `ignore` or `require`"
            )),
        }
    }
}

impl ClockSyncMode {
    /// Whether admission may proceed in `state`.
    pub fn allows(self, state: SyncState) -> bool {
        match self {
            ClockSyncMode::Ignore => true,
            ClockSyncMode::Require => matches!(state, SyncState::Synced { .. }),
        }
    }

    /// [`allows`](Self::allows) `clock`'s current state, asking the clock (a system call
    /// for the host's clock) only when the mode depends on it.
    pub fn admits(self, clock: &dyn Clock) -> bool {
        self == ClockSyncMode::Ignore || self.allows(clock.sync_state())
    }
}

/// A timer of a [`Clock`]: resolves once the clock reads at least the instant it was made for.
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A source of wall-clock time and sync state, and the timers that run on that time.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
    fn sync_state(&self) -> SyncState;

    /// Resolves when this clock reads `at_ms` or later (at once if it already does). The
    /// default sleeps on tokio's timer for the difference read now: right for a clock that
    /// runs at the host's rate (the host's own, or one shifted by a fixed offset).
    fn sleep_until(&self, at_ms: i64) -> Sleep {
        let wait = u64::try_from(at_ms.saturating_sub(self.now_ms())).unwrap_or(0);
        Box::pin(tokio::time::sleep(Duration::from_millis(wait)))
    }
}

/// A clock that moves only when told to: [`advance`](Self::advance) or
/// [`set`](Self::set). Its timers ([`Clock::sleep_until`]) fire as soon as it reads their
/// instant, however little real time has passed; so a worker on it can be walked past a
/// deadline in a test without waiting for it. Its sync state is `Synced` (0 ms error).
#[derive(Debug)]
pub struct ManualClock {
    now: tokio::sync::watch::Sender<i64>,
}

impl ManualClock {
    /// A clock reading `now_ms` until it is moved.
    pub fn new(now_ms: i64) -> Arc<Self> {
        Arc::new(Self {
            now: tokio::sync::watch::Sender::new(now_ms),
        })
    }

    /// Move the clock forward by `ms` (a negative `ms` moves it back: a clock step).
    pub fn advance(&self, ms: i64) {
        self.now.send_modify(|now| *now += ms);
    }

    /// Set the clock to `now_ms`.
    pub fn set(&self, now_ms: i64) {
        self.now.send_replace(now_ms);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        *self.now.borrow()
    }

    fn sync_state(&self) -> SyncState {
        SyncState::Synced { max_error_ms: 0 }
    }

    fn sleep_until(&self, at_ms: i64) -> Sleep {
        let mut now = self.now.subscribe();
        Box::pin(async move {
            // `wait_for` checks the current value first, then each change. The sender
            // lives as long as the clock; a clock dropped meanwhile never fires.
            if now.wait_for(|now| *now >= at_ms).await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    }
}

/// The host's clock, optionally shifted (to inject skew in tests and drills).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock {
    pub offset_ms: i64,
}

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        let d = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        d.as_millis() as i64 + self.offset_ms
    }

    fn sync_state(&self) -> SyncState {
        kernel_sync_state()
    }
}

/// A clock whose sync state is fixed, for tests of the fail-closed mode.
#[derive(Debug, Clone, Copy)]
pub struct FixedSyncClock {
    pub state: SyncState,
}

impl Clock for FixedSyncClock {
    fn now_ms(&self) -> i64 {
        SystemClock::default().now_ms()
    }
    fn sync_state(&self) -> SyncState {
        self.state
    }
}

/// Read the kernel's NTP state with `adjtimex(2)` in read-only mode (modes = 0).
#[allow(unsafe_code)]
fn kernel_sync_state() -> SyncState {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: adjtimex with modes = 0 only reads kernel state into the zeroed struct we own.
        let mut tx: libc::timex = unsafe { std::mem::zeroed() };
        let state = unsafe { libc::adjtimex(&mut tx) };
        match state {
            s if s < 0 => SyncState::Unknown,
            libc::TIME_ERROR => SyncState::Unsynced,
            _ => SyncState::Synced {
                max_error_ms: (tx.maxerror.max(0) as u64) / 1000,
            },
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        SyncState::Unknown
    }
}

/// The host's clock now, in ms since the Unix epoch (`SystemClock` without an offset).
pub fn now_ms() -> i64 {
    SystemClock::default().now_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_manual_clocks_timers_fire_when_it_is_moved_not_when_real_time_passes() {
        let clock = ManualClock::new(1_000);
        let mut early = clock.sleep_until(900);
        let mut due = clock.sleep_until(1_500);
        let polled = |s: &mut Sleep| {
            let waker = std::task::Waker::noop();
            s.as_mut()
                .poll(&mut std::task::Context::from_waker(waker))
                .is_ready()
        };
        assert!(
            polled(&mut early),
            "an instant already passed fires at once"
        );
        // Real time passing changes nothing.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!polled(&mut due));
        clock.advance(499);
        assert!(!polled(&mut due));
        clock.advance(1);
        assert!(polled(&mut due));
        // A timer waiting in a task is woken by the move.
        let task = tokio::spawn(clock.sleep_until(10_000));
        tokio::task::yield_now().await;
        assert!(!task.is_finished());
        clock.set(10_000);
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("woken by the move")
            .unwrap();
        assert_eq!(clock.now_ms(), 10_000);
    }

    #[tokio::test]
    async fn the_host_clocks_timers_run_on_real_time() {
        let clock = SystemClock::default();
        let started = std::time::Instant::now();
        clock.sleep_until(clock.now_ms() + 250).await;
        assert!(started.elapsed() >= Duration::from_millis(250));
        clock.sleep_until(clock.now_ms() - 5_000).await;
    }

    #[test]
    fn require_mode_fails_closed() {
        assert!(ClockSyncMode::Ignore.allows(SyncState::Unknown));
        assert!(!ClockSyncMode::Require.allows(SyncState::Unknown));
        assert!(!ClockSyncMode::Require.allows(SyncState::Unsynced));
        assert!(ClockSyncMode::Require.allows(SyncState::Synced { max_error_ms: 3 }));
        let unsynced = FixedSyncClock {
            state: SyncState::Unsynced,
        };
        let synced = FixedSyncClock {
            state: SyncState::Synced { max_error_ms: 3 },
        };
        assert!(ClockSyncMode::Ignore.admits(&unsynced));
        assert!(!ClockSyncMode::Require.admits(&unsynced));
        assert!(ClockSyncMode::Require.admits(&synced));
        let c = SystemClock { offset_ms: 5_000 };
        assert!(c.now_ms() - now_ms() >= 4_900);
        // Reading the kernel state must not panic, whatever it says here.
        let _ = SystemClock::default().sync_state();
    }
}
