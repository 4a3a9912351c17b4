//! Micro-benchmarks of the hot pure functions: envelope parsing and the admission
//! decision (`cargo bench -p lastcall-core`).

use criterion::{Criterion, criterion_group, criterion_main};
use lastcall_core::{
    AdmissionPolicy, Deadline, Envelope, EnvelopeLimits, JobId, Kind, WorkerPolicy,
};
use std::hint::black_box;

fn sample(now_ms: i64) -> Vec<u8> {
    let payload = serde_json::json!({"messages": [
        {"role": "system", "content": "Summarize the incident for the on-call operator in one sentence."},
        {"role": "user", "content": "api-gateway p99 latency above 2s since 14:02, error rate 4%"}
    ]});
    Envelope::new(
        JobId::parse("job-bench-1").unwrap(),
        Kind::parse("incident.summary").unwrap(),
        Deadline::from_budget(now_ms, 2_000),
        Some(200),
        Some("trace-1".into()),
        payload.as_object().unwrap().clone(),
    )
    .to_bytes()
}

fn benches(c: &mut Criterion) {
    let now = 1_700_000_000_000;
    let body = sample(now);
    let limits = EnvelopeLimits::default();
    c.bench_function("envelope_parse", |b| {
        b.iter(|| Envelope::parse(black_box(&body), &limits, black_box(now + 5)))
    });
    let env = Envelope::parse(&body, &limits, now).unwrap();
    let admission = AdmissionPolicy::default();
    c.bench_function("admission_check", |b| {
        b.iter(|| {
            admission.check(
                black_box(env.deadline()),
                env.min_runtime_ms,
                black_box(now + 500),
            )
        })
    });
    let policy = WorkerPolicy::default();
    c.bench_function("worker_policy_on_slot", |b| {
        b.iter(|| policy.on_slot(black_box(&env), None, black_box(now + 500)))
    });
}

criterion_group!(core_benches, benches);
criterion_main!(core_benches);
