//! The lastcall producer API: everything that puts a job in, or takes one back, on the
//! producer's side of the broker. `lastcall-http` (`serve`) and the CLI (`submit`,
//! `cancel`) use it; it knows nothing of the worker runtime.
//!
//! # Layout
//! - [`submit`]: [`Submitter`]: validate, stamp the deadline, refuse stale work, sign,
//!   publish with confirm (the broker TTL is the budget left at the publish), record
//!   `accepted`; `submit_once` claims the job id in the ledger before publishing (the
//!   ingress's exactly-one-publish path).
//! - [`shed`]: shedding at the door: refuse a job the queue wait would make expire.
//! - [`cancel`]: cancel a job: the ledger first, then the broadcasts.
//! - [`events`]: the outcome event of a job as the ledger holds it.

pub mod cancel;
pub mod events;
pub mod shed;
pub mod submit;

pub use events::job_event;
pub use submit::{
    DeadlineSpec, NewJob, SigningKeyError, Submission, SubmitError, Submitted, Submitter,
    load_signing_key, new_job_id,
};
