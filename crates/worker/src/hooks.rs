//! Test-only hooks, compiled only with the cargo feature `test-hooks` (the CLI's tests
//! enable it through their dev-dependency; `cargo build --release -p lastcall` does not).
//! Without the feature the hooks are empty functions and the fields they read do not
//! exist, so a production binary cannot be configured to pause or delay.

#[cfg(feature = "test-hooks")]
pub use crate::config::Fault;
use crate::config::WorkerConfig;

/// Expands the first block in a build with the `test-hooks` feature of `lastcall-worker`,
/// the `else` block otherwise: the CLI declares its test-only flags with it, so they exist
/// only where the hooks do.
#[cfg(feature = "test-hooks")]
#[macro_export]
macro_rules! with_test_hooks {
    ({ $($on:tt)* } else { $($off:tt)* }) => { $($on)* };
}

/// Expands the first block in a build with the `test-hooks` feature of `lastcall-worker`,
/// the `else` block otherwise (this build: the `else` block).
#[cfg(not(feature = "test-hooks"))]
#[macro_export]
macro_rules! with_test_hooks {
    ({ $($on:tt)* } else { $($off:tt)* }) => { $($off)* };
}

/// The deliberate wait between a slot and the admission check
/// ([`WorkerConfig::hold_before_admission`]): reproduces the seed's experiment (work
/// delivered in time that waits locally past its deadline).
pub(crate) async fn hold_before_admission(cfg: &WorkerConfig) {
    #[cfg(feature = "test-hooks")]
    if !cfg.hold_before_admission.is_zero() {
        tokio::time::sleep(cfg.hold_before_admission).await;
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = cfg;
}

/// [`Fault::PauseAfterStore`]: stop for good after a durable write, before event and ack.
pub(crate) async fn pause_after_store(cfg: &WorkerConfig) {
    #[cfg(feature = "test-hooks")]
    if cfg.fault == Some(Fault::PauseAfterStore) {
        tracing::error!("fault: paused after store (outcome is durable, event and ack withheld)");
        std::future::pending::<()>().await;
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = cfg;
}
