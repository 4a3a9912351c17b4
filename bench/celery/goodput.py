"""Celery 5.x through `lastcall bench goodput`'s overload scenario (see README.md).

One file plays two roles:
- imported by `celery -A goodput worker` (a subprocess per run): the Celery app, the task
  (a sleep of the drawn call time, or with --service smollm2-mixed a chat completion at
  --openai-url) and signal handlers that append one JSON line per event to the results
  file;
- run as a script: starts that worker on a fresh queue, submits jobs at the target rate
  with `apply_async(expires=<deadline>)`, waits for every outcome, prints the results.

Events in the results file (times are wall-clock ms on this host):
  {"e": "sub", "id", "t", "deadline", "size"}   published (the producer; size: the
                                       call ms, or the prompt's tokens at 4 chars each)
  {"e": "ready"}                       worker_ready
  {"e": "recv", "id", "t"}             task_received (passed Celery's check at receipt)
  {"e": "run", "id", "start", "end"}   the task body ran (the "model call")
  {"e": "fail", "id", "start", "end"}  the call to --openai-url failed
  {"e": "revoked", "id", "t"}          task_revoked(expired=True): refused by the worker
A task revoked without a "recv" line was refused at receipt; with one, when it reached
the pool. Messages RabbitMQ dropped (Celery also sets the message TTL from `expires`) are
dead-lettered to `<queue>.expired` and counted there.
"""

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone

import celery
from celery import Celery, signals
from kombu import Queue

QUEUE = os.environ.get("LCB_QUEUE", "lastcall-celery-bench")
RESULTS = os.environ.get("LCB_RESULTS", os.devnull)
BROKER = os.environ.get("LCB_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
OPENAI_URL = os.environ.get("LCB_OPENAI_URL", "")
OPENAI_MODEL = os.environ.get("LCB_OPENAI_MODEL", "smollm2")

app = Celery("lastcall_celery_bench", broker=BROKER)
app.conf.update(
    task_ignore_result=True,
    worker_enable_remote_control=False,  # no pidbox queue left behind
    broker_connection_retry_on_startup=True,
    broker_transport_options={"confirm_publish": True},  # count confirmed publishes
)


def bench_queue(name):
    """The run's queue (same arguments in the worker and the producer); broker expiries
    are dead-lettered to `<queue>.expired` so that every job has a counted outcome."""
    return Queue(name, routing_key=name, queue_arguments={
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": name + ".expired",
    })


app.conf.task_queues = [bench_queue(QUEUE)]  # the worker's (QUEUE comes from the script)


def now_ms():
    return time.time() * 1000.0


def record(**event):
    # One O_APPEND write per line: safe across the prefork children and the main process.
    fd = os.open(RESULTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())
    finally:
        os.close(fd)


@app.task(name="lastcall_bench.call")
def call(call_ms):
    start = now_ms()
    time.sleep(call_ms / 1000.0)  # the "model call"
    record(e="run", id=call.request.id, start=start, end=now_ms())


@app.task(name="lastcall_bench.chat")
def chat(payload):
    """The model call of --service smollm2-mixed: one chat completion at the server, not
    streamed (Celery cannot cancel it, so it is not cut at the deadline either)."""
    start = now_ms()
    body = dict(payload, model=OPENAI_MODEL)
    req = urllib.request.Request(OPENAI_URL.rstrip("/") + "/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
    except Exception as e:  # noqa: BLE001 - counted as the job's outcome
        record(e="fail", id=chat.request.id, start=start, end=now_ms(), error=repr(e))
        return
    record(e="run", id=chat.request.id, start=start, end=now_ms())


@signals.worker_ready.connect
def _ready(**_):
    record(e="ready")


@signals.task_received.connect
def _received(request=None, **_):
    record(e="recv", id=request.id, t=now_ms())


@signals.task_revoked.connect
def _revoked(request=None, expired=False, **_):
    record(e="revoked", id=request.id, t=now_ms(), expired=expired)


# ---------------------------------------------------------------- the benchmark (script)


# --service smollm2-mixed: the same draws as `lastcall bench goodput` (crates/bench/src/
# goodput.rs, `mixed_payload`): prompts of 30–2,000 tokens (log-uniform, 4 characters a
# token) cut from this text at a random place after a ticket number, max_tokens 4–64.
MIXED_MIN_TOKENS, MIXED_MAX_TOKENS = 30.0, 2000.0
FILLER = (
    "The on-call engineer was paged at night because the checkout service returned errors "
    "for a growing share of requests. The dashboards showed the database primary at full "
    "CPU while the replicas were idle, and the connection pool of every web server was "
    "exhausted. A deploy earlier that evening had added a query without an index on the "
    "orders table, and each retry of a failed request made the load worse. The team rolled "
    "the deploy back, added the index during a quiet period, and raised the alert threshold "
    "for the pool. Customers saw slow pages for about forty minutes and some payments had "
    "to be retried by hand. ")


def mixed_payload():
    lo, hi = math.log(MIXED_MIN_TOKENS), math.log(MIXED_MAX_TOKENS)
    tokens = round(math.exp(lo + random.random() * (hi - lo)))
    max_tokens = random.randint(4, 64)
    head = (f"Ticket {random.randrange(10000, 100000)}. "
            "Summarize these incident notes in one sentence.\n\n")
    want = max(1, tokens * 4 - len(head))
    body = FILLER[random.randrange(len(FILLER)):]
    while len(body) < want:
        body += FILLER
    content = head + body[:want]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def parse_service(s):
    """`fixed:MS`, `lognormal:MEAN_MS,SIGMA` or `smollm2-mixed` → (mean ms or None, the
    task, draw() → (its arguments, what the "sub" event records))."""
    name, _, rest = s.partition(":")
    if name == "fixed":
        ms = int(rest)
        return ms, call, lambda: ((ms,), ms)
    if name == "lognormal":
        mean, sigma = int(rest.split(",")[0]), float(rest.split(",")[1])
        mu = math.log(mean) - sigma * sigma / 2.0

        def draw():
            ms = max(1, round(random.lognormvariate(mu, sigma)))
            return (ms,), ms
        return mean, call, draw
    if s == "smollm2-mixed":
        def draw_mixed():
            p = mixed_payload()
            return (p,), len(p["messages"][0]["content"]) // 4
        return None, chat, draw_mixed
    raise SystemExit(f"--service {s!r}: expected fixed:MS, lognormal:MEAN_MS,SIGMA or "
                     "smollm2-mixed (with --openai-url and --capacity-per-s)")


def read_events(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


STOP = []  # set by SIGTERM/SIGINT; checked at safe points (an exception raised inside a
# py-amqp read leaves the connection unusable and the cleanup hangs)


def check_stop():
    if STOP:
        raise SystemExit(f"stopped by signal {STOP[0]}")


def poll(cond, timeout_s, what, every_s=0.25):
    end = time.monotonic() + timeout_s
    while not cond():
        check_stop()
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(every_s)


def queue_op(op, name):
    """`count` (messages in a queue), `declare` or `delete`, over Celery's own connection."""
    with app.connection_for_write() as conn:
        ch = conn.default_channel
        if op == "count":
            return ch.queue_declare(queue=name, passive=True).message_count
        if op == "declare":
            ch.queue_declare(queue=name, durable=True, auto_delete=False)
        elif op == "delete":
            ch.queue_delete(queue=name)
        else:  # Celery declares its default exchange `celery` too; delete it if unused
            ch.exchange_delete(exchange=name, if_unused=True)


def cleanup(queue):
    for op, name in [("delete", queue), ("delete", queue + ".expired"),
                     ("exchange-delete", app.conf.task_default_exchange or "celery")]:
        try:
            queue_op(op, name)
        except Exception as e:  # noqa: BLE001 - best effort (the exchange may be in use)
            if op == "delete":
                print(f"could not delete queue {name}: {e!r}", file=sys.stderr)


def run_one(a, overload, mean_ms, task, draw, tmp):
    global RESULTS  # the producer's "sub" events go to the run's file too
    capacity = a.capacity_per_s or a.slots * 1000.0 / mean_ms
    mean_ms = mean_ms or a.slots * 1000.0 / capacity
    rate = capacity * overload
    total = max(1, round(rate * a.duration_s))
    queue = f"lastcall-celery-bench-{os.getpid()}-{int(time.time() * 1000):x}-{overload:g}x"
    results = os.path.join(tmp, queue + ".jsonl")
    log = os.path.join(tmp, queue + ".log")
    open(results, "w").close()
    env = dict(os.environ, LCB_QUEUE=queue, LCB_RESULTS=results, LCB_AMQP_URL=a.amqp_url,
               LCB_OPENAI_URL=a.openai_url or "", LCB_OPENAI_MODEL=a.openai_model)
    RESULTS = results
    cmd = [sys.executable, "-m", "celery", "-A", "goodput", "worker", "-P", a.pool,
           "-c", str(a.slots), "--prefetch-multiplier", str(a.prefetch_multiplier),
           "-Q", queue, "-n", queue + "@%h", "-l", "WARNING",
           "--without-gossip", "--without-mingle", "--without-heartbeat"]
    if not a.json:
        print(f"{a.service} at {overload:g}×: {total} jobs at {rate:.1f}/s for "
              f"{a.duration_s:g} s; capacity {capacity:.1f}/s; "
              f"deadline {'|'.join(map(str, a.deadline_ms))} ms; "
              f"worker -P {a.pool} -c {a.slots}, prefetch {a.slots * a.prefetch_multiplier}; "
              f"queue {queue}", file=sys.stderr)
    worker = None
    try:
        queue_op("declare", queue + ".expired")
        with open(log, "w") as logf:
            worker = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      cwd=os.path.dirname(os.path.abspath(__file__)))

        def ready():
            if worker.poll() is not None:
                with open(log) as f:
                    tail = "".join(f.readlines()[-20:])
                raise SystemExit(f"celery worker exited ({worker.returncode}):\n{tail}")
            return any(e["e"] == "ready" for e in read_events(results))

        poll(ready, 60, "the celery worker to start")

        jobs = {}  # id -> (submitted ms, deadline ms, call ms)
        submit_errors = 0
        gap = 1.0 / rate
        t0 = time.monotonic()
        target = bench_queue(queue)
        with app.producer_or_acquire() as producer:
            for i in range(total):
                check_stop()
                delay = t0 + i * gap - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # pacing the arrivals (catches up if behind)
                (args, size), task_id = draw(), f"{queue}-{i}"
                sub = now_ms()
                deadline = sub + random.choice(a.deadline_ms)  # uniform, as lastcall's
                try:
                    task.apply_async(
                        args, task_id=task_id, producer=producer, queue=target,
                        expires=datetime.fromtimestamp(deadline / 1000.0, timezone.utc))
                    jobs[task_id] = (sub, deadline, size)
                    record(e="sub", id=task_id, t=sub, deadline=deadline, size=size)
                except Exception as e:  # noqa: BLE001 - a refused publish is counted
                    submit_errors += 1
                    print(f"publish failed: {e!r}", file=sys.stderr)
        submit_s = time.monotonic() - t0
        last_deadline = max((d for _, d, _ in jobs.values()), default=now_ms())

        # Every job ends as exactly one of: ran, revoked by the worker, dropped by the broker.
        def outcomes():
            ev = read_events(results)
            done = {e["id"] for e in ev if e["e"] in ("run", "revoked", "fail")}
            return ev, len(done) + queue_op("count", queue + ".expired")

        grace_ms = 3000 + 10 * mean_ms  # as lastcall's bench
        timeout = max(0.0, (last_deadline + grace_ms - now_ms()) / 1000.0)
        try:
            poll(lambda: outcomes()[1] >= len(jobs), timeout, "all outcomes")
        except TimeoutError as e:
            print(f"warning: {e}; reporting what arrived", file=sys.stderr)
        events, _ = outcomes()
        broker_expired = queue_op("count", queue + ".expired")
    finally:
        stop_worker(worker)
        cleanup(queue)

    return summarise(a, overload, capacity, rate, jobs, submit_errors, submit_s, events,
                     broker_expired)


def stop_worker(worker):
    """Warm shutdown (SIGTERM), then SIGKILL to the worker's process group after 15 s."""
    if worker is None or worker.poll() is not None:
        return
    worker.terminate()
    try:
        worker.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def pct(values, q):
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def summarise(a, overload, capacity, rate, jobs, submit_errors, submit_s, events,
              broker_expired):
    received = {e["id"]: e["t"] for e in events if e["e"] == "recv"}
    runs = {e["id"]: e for e in events if e["e"] == "run" and e["id"] in jobs}
    revoked = {e["id"] for e in events if e["e"] == "revoked" and e["id"] in jobs}
    failed = {e["id"]: e for e in events if e["e"] == "fail" and e["id"] in jobs}
    on_time = late = started_late = 0
    model_ms = wasted_ms = 0.0
    for tid, r in runs.items():
        _, deadline, _ = jobs[tid]
        took = r["end"] - r["start"]
        model_ms += took
        if r["end"] <= deadline:
            on_time += 1
        else:
            late += 1  # Celery never cancels a running task: it ran to the end, uselessly
            wasted_ms += took
        if r["start"] > deadline:
            started_late += 1
    for r in failed.values():  # a failed call's time is wasted too
        model_ms += r["end"] - r["start"]
        wasted_ms += r["end"] - r["start"]
    first = min((s for s, _, _ in jobs.values()), default=0.0)
    window_s = max(0.001, (max((d for _, d, _ in jobs.values()), default=0.0) - first) / 1000)
    bound = min(capacity * window_s, len(jobs))
    # On-time completions per second since the first submission (by the body's end), as
    # lastcall's `on_time_per_s`: the chart of `lastcall bench goodput --celery`.
    on_time_per_s = [0] * (math.ceil(window_s) + 1)
    for tid, r in runs.items():
        if r["end"] <= jobs[tid][1]:
            b = int((r["end"] - first) // 1000)
            if 0 <= b < len(on_time_per_s):
                on_time_per_s[b] += 1
    exp_at_pool = len([t for t in revoked if t in received])
    return {
        "service": a.service,
        "pool": a.pool,
        "overload": overload,
        "arrival_per_s": rate,
        "submit_s": submit_s,
        "submitted": len(jobs),
        "submit_errors": submit_errors,
        "on_time": on_time,
        "capacity_bound": bound,
        "window_s": window_s,
        "goodput": on_time / max(bound, 1.0),
        "completed_late": late,
        "started_after_deadline": started_late,
        "model_calls": len(runs),
        "model_time_s": model_ms / 1000,
        "wasted_model_time": wasted_ms / max(model_ms, 1.0),
        "expired_in_broker": broker_expired,
        "expired_at_receipt": len(revoked) - exp_at_pool,
        "expired_at_pool": exp_at_pool,
        "failed": len(failed),
        "no_outcome": len(jobs) - len(runs) - len(revoked) - len(failed) - broker_expired,
        "dispatch_p99_ms": pct([r["start"] - received[t] for t, r in runs.items()
                                if t in received], 0.99),
        "on_time_per_s": on_time_per_s,
    }


def table(rows):
    cols = [("service", "service"), ("pool", "pool"), ("overload", "overload"),
            ("submitted", "submitted"), ("on_time", "on_time"), ("goodput", "goodput"),
            ("late_done", "completed_late"), ("started_late", "started_after_deadline"),
            ("wasted_time", "wasted_model_time"), ("exp_broker", "expired_in_broker"),
            ("exp_receipt", "expired_at_receipt"), ("exp_pool", "expired_at_pool"),
            ("no_outcome", "no_outcome"), ("dispatch_p99_ms", "dispatch_p99_ms")]

    def cell(k, v):
        if k in ("goodput", "wasted_model_time"):
            return f"{v * 100:.1f}%"
        if k == "overload":
            return f"{v:g}×"
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    cells = [[h for h, _ in cols]] + [[cell(k, r[k]) for _, k in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--service", default="fixed:200",
                   help="call durations: fixed:MS or lognormal:MEAN_MS,SIGMA")
    p.add_argument("--overload", default="2,5,10", help="comma-separated multiples of capacity")
    p.add_argument("--slots", type=int, default=4, help="worker concurrency")
    p.add_argument("--deadline-ms", default="2000",
                   type=lambda s: [int(x) for x in s.split(",")],
                   help="each job's deadline, ms after its submission; a comma-separated "
                        "list draws one per job, uniformly (as lastcall's)")
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--pool", default="prefork", choices=["prefork", "threads"])
    p.add_argument("--prefetch-multiplier", type=int, default=2)
    p.add_argument("--amqp-url", default=BROKER)
    p.add_argument("--openai-url", help="with --service smollm2-mixed: the OpenAI-compatible "
                   "server the task calls, e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--openai-model", default="smollm2", help="the model name sent to it")
    p.add_argument("--capacity-per-s", type=float,
                   help="the capacity (jobs/s) that sets the arrival rates and the bound "
                        "[default: slots × 1000 ÷ the mean call ms; required with a server]")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--keep-events", metavar="DIR",
                   help="keep the raw event files and worker logs in DIR (default: discarded)")
    a = p.parse_args()
    mean_ms, task, draw = parse_service(a.service)
    if mean_ms is None and not (a.openai_url and a.capacity_per_s):
        raise SystemExit(f"--service {a.service} needs --openai-url and --capacity-per-s")
    app.conf.broker_url = a.amqp_url
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda n, _: STOP.append(n))

    rows = []
    with tempfile.TemporaryDirectory(prefix="lastcall-celery-bench-") as tmp:
        if a.keep_events:
            os.makedirs(a.keep_events, exist_ok=True)
        for o in [float(x) for x in a.overload.split(",")]:
            rows.append(run_one(a, o, mean_ms, task, draw, a.keep_events or tmp))
    if a.json:
        print(json.dumps({"bench": "goodput", "system": f"celery {celery.__version__}",
                          "slots": a.slots,
                          # an int as before; a list for mixed deadlines
                          "deadline_ms": a.deadline_ms[0] if len(a.deadline_ms) == 1
                          else a.deadline_ms,
                          "duration_s": a.duration_s,
                          "prefetch": a.slots * a.prefetch_multiplier, "results": rows},
                         indent=2))
    else:
        print(f"celery {celery.__version__}, -P {a.pool}")
        print(table(rows))
        for r in rows:
            print(f"{r['service']} at {r['overload']:g}×: capacity bound "
                  f"{r['capacity_bound']:.0f} over a {r['window_s']:.1f} s window; "
                  f"model calls {r['model_calls']}, {r['model_time_s']:.1f} s; "
                  f"submitting took {r['submit_s']:.1f} s; submit errors {r['submit_errors']}")


if __name__ == "__main__":
    main()
