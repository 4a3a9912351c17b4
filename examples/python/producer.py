#!/usr/bin/env python3
"""A lastcall producer in Python: publish one job with pika, then wait for its outcome.

It builds a v1 envelope (docs/wire-format.md §2), signs it when a key is given (§5),
publishes it to `{prefix}.jobs` with the properties of §3 (publisher confirms, mandatory,
the *remaining* budget as the message TTL), then long-polls `GET {base}/v1/jobs/{id}` of
`lastcall serve` until the job has a terminal outcome.

Exit codes:
  0  completed
  1  another terminal outcome (failed, rejected, unknown, cancelled), or an error after
     the job was published
  2  not published: bad arguments, a remaining budget <= 0, or the broker refused it
     (unreachable, nack, unroutable, no exchange)
  3  expired: expired_not_started, expired_before_receive or deadline_exceeded
  4  no outcome seen before expires_at_ms + grace (or the outcome could not be read)

Only pika comes from outside the standard library (scripts/setup-python-example.sh
installs it into a private venv). `--self-test` checks the signing function against the
test vector of docs/wire-format.md §5 and needs no broker.
"""

import argparse
import hashlib
import hmac
import json
import os
import re
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

TERMINAL = {
    "completed",
    "failed",
    "expired_not_started",
    "expired_before_receive",
    "deadline_exceeded",
    "rejected",
    "unknown",
    "cancelled",
}
EXPIRED = {"expired_not_started", "expired_before_receive", "deadline_exceeded"}

EXIT_COMPLETED = 0
EXIT_OTHER = 1
EXIT_NOT_PUBLISHED = 2
EXIT_EXPIRED = 3
EXIT_NO_OUTCOME = 4

JOB_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
KIND_RE = re.compile(r"^[a-z0-9._-]{1,64}$")
TENANT_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
PRIORITIES = ("critical", "standard", "batch")
MIN_KEY_BYTES = 32
MAX_WAIT_MS = 60_000
# Against a server that answers at once (no long-poll), poll at most this often.
MIN_POLL_INTERVAL_S = 0.2


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def log(msg: str) -> None:
    print(f"producer: {msg}", file=sys.stderr, flush=True)


# --- §5: the signature ------------------------------------------------------------------


def lastcall_signature(key: bytes, job_id: str, expires_at_ms: int, body: bytes) -> str:
    """`x-lastcall-signature`: HMAC-SHA256 over a length-prefixed encoding of the job id,
    the deadline and the exact body bytes published (crates/core/src/signature.rs)."""
    jid = job_id.encode("utf-8")
    msg = (
        b"lastcall-signature-v1\0"
        + struct.pack(">I", len(jid))
        + jid
        + struct.pack(">q", expires_at_ms)
        + struct.pack(">Q", len(body))
        + body
    )
    return "v1=" + hmac.new(key, msg, hashlib.sha256).hexdigest()


def signing_key(text: str, source: str) -> bytes:
    """A key from its text form, as the Rust side reads it: surrounding whitespace (a key
    file's final newline) is not part of the key; at least 32 bytes."""
    key = text.strip().encode("utf-8")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"the signing key from {source} is {len(key)} bytes long; at least "
            f"{MIN_KEY_BYTES} are required (e.g. `openssl rand -hex 32`)"
        )
    return key


# docs/wire-format.md §2 and §5 (crates/core/tests/wire_format.rs checks the same vector).
VECTOR_KEY = b"0123456789abcdef0123456789abcdef"
VECTOR_JOB_ID = "inc-4711"
VECTOR_EXPIRES_AT_MS = 1800000030000
VECTOR_BODY = (
    b'{"schema_version":1,"job_id":"inc-4711","kind":"incident.summary",'
    b'"created_at_ms":1800000000000,"expires_at_ms":1800000030000,"min_runtime_ms":2000,'
    b'"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","payload":{"messages":[{"role":"user",'
    b'"content":"Summarise the last hour of alerts for db-7."}],"max_tokens":200}}'
)
VECTOR_SIGNATURE = "v1=deec069eaa47cf6661668e68036555c21668599ccded1876aa39a08cd02b454d"


def self_test() -> int:
    got = lastcall_signature(VECTOR_KEY, VECTOR_JOB_ID, VECTOR_EXPIRES_AT_MS, VECTOR_BODY)
    if got != VECTOR_SIGNATURE:
        print(f"self-test FAILED: signature {got}, expected {VECTOR_SIGNATURE}")
        return 1
    # A key file's trailing newline is not part of the key.
    if signing_key(VECTOR_KEY.decode() + "\n", "self-test") != VECTOR_KEY:
        print("self-test FAILED: the key's surrounding whitespace was kept")
        return 1
    # The lanes' test vectors (crates/core/src/tenant.rs, docs/wire-format.md §1).
    cases = [("default", "standard"), ("team-a", "standard"), ("team-b", "standard"),
             ("default", "critical"), ("default", "batch"), ("bulk", "batch")]
    lanes = [lane_of(t, p) for t, p in cases]
    if lanes != [0, 1, 5, 7, 3, 2]:
        print(f"self-test FAILED: lanes {lanes}")
        return 1
    print(f"self-test ok: {got}")
    return 0


# --- §2: the envelope -------------------------------------------------------------------


def build_envelope(args, created_at_ms: int) -> dict:
    payload = {"messages": [{"role": "user", "content": args.prompt}]}
    if args.max_tokens is not None:
        payload["max_tokens"] = args.max_tokens
    if args.payload_json:
        extra = json.loads(args.payload_json)
        if not isinstance(extra, dict):
            raise ValueError("--payload-json must be a JSON object")
        payload.update(extra)
    job = {
        "schema_version": 1,
        "job_id": args.job_id,
        "kind": args.kind,
        "created_at_ms": created_at_ms,
        # The absolute deadline: immutable from here on.
        "expires_at_ms": created_at_ms + args.budget_ms,
        "payload": payload,
    }
    if args.min_runtime_ms is not None:
        job["min_runtime_ms"] = args.min_runtime_ms
    if args.trace_id:
        job["trace_id"] = args.trace_id
    # Optional, inside the signed body (§2): absent means tenant `default`, tier `standard`.
    if args.tenant:
        job["tenant"] = args.tenant
    if args.priority:
        job["priority"] = args.priority
    return job


def envelope_bytes(job: dict) -> bytes:
    """The body to publish (and sign): compact UTF-8 JSON."""
    return json.dumps(job, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# --- §1 and §3: publishing --------------------------------------------------------------


class NotPublished(Exception):
    pass


LANES = 8  # the work queue and 7 lanes (docs/wire-format.md §1)


def lane_of(tenant: str, priority: str = "standard") -> int:
    """A job's lane: 0 for the `default` tenant's `standard` jobs, else
    1 + FNV-1a-64(key) mod 7, the key being the tenant, plus `/` and the tier for
    `critical` and `batch`."""
    if tenant == "default" and priority == "standard":
        return 0
    key = tenant if priority == "standard" else f"{tenant}/{priority}"
    h = 0xCBF29CE484222325
    for b in key.encode():
        h ^= b
        h = (h * 0x100000001B3) % (1 << 64)
    return 1 + h % (LANES - 1)


def job_route(prefix: str, job: dict):
    """(exchange, routing key): the jobs exchange by kind for lane 0, the lanes exchange
    by lane number for the others."""
    lane = lane_of(job.get("tenant", "default"), job.get("priority", "standard"))
    if lane == 0:
        return f"{prefix}.jobs", job["kind"]
    return f"{prefix}.lanes", str(lane)


def publish(args, job: dict, body: bytes, signature) -> int:
    """Publish with confirm on a connection of its own; returns the TTL sent (ms). Raises
    NotPublished."""
    import pika  # only here, so that --self-test runs without it

    try:
        conn = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    except pika.exceptions.AMQPError as e:
        raise NotPublished(f"cannot connect to the broker: {e!r}") from e
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        return publish_on(channel, args.prefix, job, body, signature)
    finally:
        try:
            conn.close()
        except Exception:  # already closed by the broker
            pass


def publish_on(channel, prefix: str, job: dict, body: bytes, signature) -> int:
    """Publish one job on `channel` (in confirm mode: `channel.confirm_delivery()`) and wait
    for the broker's confirm; returns the TTL sent (ms). Raises NotPublished. A producer
    that publishes many jobs keeps one connection and channel for all of them."""
    import pika
    from pika.compat import long as amqp_long

    exchange, routing_key = job_route(prefix, job)
    headers = {"x-lastcall-attempt": amqp_long(0)}  # a long, as the Rust side sends it
    if signature is not None:
        headers["x-lastcall-signature"] = signature
    # The TTL is the budget left *at this publish*, never the total budget.
    now = now_ms()
    remaining = job["expires_at_ms"] - now
    if remaining <= 0:
        raise NotPublished(
            f"not publishing job {job['job_id']}: its remaining budget is {remaining} ms "
            f"(expires_at_ms {job['expires_at_ms']}, now {now}); it would only expire"
        )
    props = pika.BasicProperties(
        delivery_mode=2,
        content_type="application/json",
        message_id=job["job_id"],
        timestamp=now // 1000,
        expiration=str(remaining),
        headers=headers,
    )
    try:
        channel.basic_publish(
            exchange=exchange,
            routing_key=routing_key,
            body=body,
            properties=props,
            mandatory=True,
        )
    except pika.exceptions.UnroutableError as e:
        raise NotPublished(
            f"the broker returned the job as unroutable: nothing is bound for kind "
            f"{job['kind']!r} on {exchange} (run `lastcall topology apply`?): {e!r}"
        ) from e
    except pika.exceptions.NackError as e:
        raise NotPublished(f"the broker nacked the job: {e!r}") from e
    except pika.exceptions.ChannelClosedByBroker as e:
        raise NotPublished(
            f"the broker closed the channel (no exchange {exchange}? run "
            f"`lastcall topology apply`): {e.reply_code} {e.reply_text}"
        ) from e
    except pika.exceptions.AMQPError as e:
        raise NotPublished(f"publish failed: {e!r}") from e
    return remaining


# --- §7: waiting for the outcome --------------------------------------------------------


def get_job(base: str, job_id: str, wait_ms: int, token):
    """One `GET /v1/jobs/{id}?wait_ms=N`: (HTTP status, parsed JSON or None)."""
    url = f"{base.rstrip('/')}/v1/jobs/{urllib.parse.quote(job_id, safe='')}?wait_ms={wait_ms}"
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=wait_ms / 1000 + 10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            data = json.loads(e.read() or b"null")
        except ValueError:
            data = None
        return e.code, data


def wait_for_outcome(args, job_id: str, until_ms: int, token):
    """Long-poll until a terminal record or `until_ms`. Returns (record or None, why)."""
    last = None
    while True:
        left = until_ms - now_ms()
        if left <= 0:
            return last, "no terminal outcome before the deadline + grace"
        wait_ms = min(MAX_WAIT_MS, args.poll_wait_ms, left)
        started = time.monotonic()
        try:
            status, data = get_job(args.http_url, job_id, wait_ms, token)
        except (urllib.error.URLError, OSError, ValueError) as e:
            # The server is unreachable for a moment (or answered garbage): try again.
            log(f"GET /v1/jobs/{job_id}: {e}")
            status, data = None, None
        if status == 200 and isinstance(data, dict):
            last = data
            if data.get("state") in TERMINAL:
                return data, "terminal"
        elif status in (401, 403):
            msg = data.get("message") if isinstance(data, dict) else data
            return last, f"the server refused the token ({status}): {msg} (set LASTCALL_TOKEN)"
        elif status is not None and status != 404:
            # 404: no ledger row yet (the worker has not recorded anything): not yet.
            log(f"GET /v1/jobs/{job_id}: HTTP {status}: {data}")
        # A server without the long-poll answers at once: do not spin.
        pause = MIN_POLL_INTERVAL_S - (time.monotonic() - started)
        if pause > 0:
            time.sleep(min(pause, max(0, until_ms - now_ms()) / 1000))


def print_record(rec: dict) -> None:
    for field in ("job_id", "state", "reason", "backend_calls", "result", "error"):
        value = rec.get(field)
        if field == "error" and value is None:
            continue
        print(f"{field}: {'-' if value is None else value}")


def exit_code(state) -> int:
    if state == "completed":
        return EXIT_COMPLETED
    if state in EXPIRED:
        return EXIT_EXPIRED
    return EXIT_OTHER


# --- the command line -------------------------------------------------------------------


def parse_args(argv):
    env = os.environ.get
    p = argparse.ArgumentParser(
        description="Publish one lastcall job with pika and wait for its outcome "
        "over HTTP (lastcall serve).",
        epilog="Environment: LASTCALL_TOKEN (bearer token of lastcall serve; else "
        "LASTCALL_HTTP_TOKEN), LASTCALL_SIGNING_KEY (the workers' signing key; else "
        "--signing-key-file; neither: unsigned). Exit codes: 0 completed, 1 other outcome "
        "or error, 2 not published, 3 expired, 4 no outcome in time.",
    )
    p.add_argument("--amqp-url", default=env("LASTCALL_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
    p.add_argument("--prefix", default=env("LASTCALL_PREFIX", "lastcall"),
                   help="topology prefix: publishes to {prefix}.jobs (default lastcall)")
    p.add_argument("--http-url", default=env("LASTCALL_HTTP_URL", "http://127.0.0.1:8080"),
                   help="base URL of lastcall serve (default http://127.0.0.1:8080)")
    p.add_argument("--budget-ms", type=int, default=int(env("LASTCALL_BUDGET_MS", "30000")),
                   help="deadline budget from now, ms: expires_at_ms = now + budget (default 30000)")
    p.add_argument("--job-id", default=None, help="default: a random UUID")
    p.add_argument("--kind", default="incident.summary", help="job kind and routing key")
    p.add_argument("--prompt", default="Summarise the last hour of alerts for db-7.",
                   help="the user message of payload.messages")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--payload-json", default=None,
                   help='extra payload fields, a JSON object merged in (e.g. \'{"sim_latency_ms": 5000}\')')
    p.add_argument("--min-runtime-ms", type=int, default=None)
    p.add_argument("--trace-id", default=None)
    p.add_argument("--tenant", default=None,
                   help="whose job it is: 1-64 characters of [A-Za-z0-9._:-] (default: none, "
                        "the job belongs to tenant `default`)")
    p.add_argument("--priority", default=None, choices=PRIORITIES,
                   help="priority tier under overload (default: none, i.e. `standard`)")
    p.add_argument("--signing-key-file", default=None,
                   help="file holding the signing key (else LASTCALL_SIGNING_KEY)")
    p.add_argument("--grace-ms", type=int, default=30_000,
                   help="keep waiting this long after expires_at_ms (default 30000)")
    p.add_argument("--poll-wait-ms", type=int, default=MAX_WAIT_MS,
                   help=f"wait_ms of each long-poll, at most {MAX_WAIT_MS} (default {MAX_WAIT_MS})")
    p.add_argument("--no-wait", action="store_true", help="publish only; exit 0 once confirmed")
    p.add_argument("--self-test", action="store_true",
                   help="check the signing function against the test vector of docs/wire-format.md and exit 0/1")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.self_test:
        return self_test()

    if args.job_id is None:
        args.job_id = str(uuid.uuid4())
    problems = []
    if not JOB_ID_RE.match(args.job_id):
        problems.append(f"--job-id {args.job_id!r}: 1-128 characters of [A-Za-z0-9._:-]")
    if not KIND_RE.match(args.kind):
        problems.append(f"--kind {args.kind!r}: 1-64 characters of [a-z0-9._-]")
    if args.tenant is not None and not TENANT_RE.match(args.tenant):
        problems.append(f"--tenant {args.tenant!r}: 1-64 characters of [A-Za-z0-9._:-]")
    if args.grace_ms < 0 or args.poll_wait_ms < 1:
        problems.append("--grace-ms must be >= 0 and --poll-wait-ms >= 1")
    key = None
    try:
        if args.signing_key_file:
            with open(args.signing_key_file, encoding="utf-8") as f:
                key = signing_key(f.read(), args.signing_key_file)
        elif os.environ.get("LASTCALL_SIGNING_KEY"):
            key = signing_key(os.environ["LASTCALL_SIGNING_KEY"], "LASTCALL_SIGNING_KEY")
    except (OSError, ValueError) as e:
        problems.append(str(e))
    created_at_ms = now_ms()
    try:
        job = build_envelope(args, created_at_ms)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        for msg in problems:
            log(f"error: {msg}")
        return EXIT_NOT_PUBLISHED
    if args.budget_ms <= 0:
        log(f"error: not publishing job {args.job_id}: its budget is {args.budget_ms} ms; "
            "a job whose remaining budget is <= 0 would only expire")
        return EXIT_NOT_PUBLISHED

    # The exact bytes published are the bytes signed.
    body = envelope_bytes(job)
    signature = lastcall_signature(key, job["job_id"], job["expires_at_ms"], body) if key else None
    try:
        ttl = publish(args, job, body, signature)
    except NotPublished as e:
        log(f"error: {e}")
        return EXIT_NOT_PUBLISHED
    log(f"published job {job['job_id']} to {args.prefix}.jobs (kind {job['kind']}, "
        f"expires_at_ms {job['expires_at_ms']}, ttl {ttl} ms, "
        f"{'signed' if signature else 'unsigned'}); confirmed by the broker")
    if args.no_wait:
        print(f"job_id: {job['job_id']}")
        return EXIT_COMPLETED

    token = os.environ.get("LASTCALL_TOKEN") or os.environ.get("LASTCALL_HTTP_TOKEN")
    until_ms = job["expires_at_ms"] + args.grace_ms
    rec, why = wait_for_outcome(args, job["job_id"], until_ms, token)
    if why != "terminal":
        log(f"error: job {job['job_id']}: {why}")
        if rec is not None:
            print_record(rec)
        else:
            print(f"job_id: {job['job_id']}\nstate: -")
        return EXIT_NO_OUTCOME
    print_record(rec)
    return exit_code(rec.get("state"))


if __name__ == "__main__":
    sys.exit(main())
