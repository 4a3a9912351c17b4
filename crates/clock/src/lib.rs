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

use std::time::{SystemTime, UNIX_EPOCH};

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

/// A source of wall-clock time and sync state.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
    fn sync_state(&self) -> SyncState;
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
