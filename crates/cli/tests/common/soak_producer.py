#!/usr/bin/env python3
"""The soak test's pika producer (crates/cli/tests/common/soak.rs).

Publishes jobs at a steady rate to `{prefix}.jobs` on one connection in confirm mode,
with the Python example's own code (examples/python/producer.py: the envelope, the
remaining budget as the TTL, `publish_on`). After a broker restart it connects again at
the next job. One line per job on stdout, flushed: `confirmed JOB_ID` once the broker
confirmed it, else `failed JOB_ID REASON`. Stops at SIGTERM.
"""

import argparse
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "examples", "python"))

import pika  # noqa: E402
import producer  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--amqp-url", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--rate", type=float, required=True, help="jobs per second")
    p.add_argument("--budget-ms", type=int, required=True)
    p.add_argument("--id-prefix", required=True, help="job ids are ID_PREFIX-000000, …")
    args = p.parse_args()

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    conn = channel = None
    every = 1.0 / args.rate
    next_at = time.monotonic()
    n = 0
    while not stopping:
        now = time.monotonic()
        if now < next_at:
            time.sleep(min(next_at - now, 0.2))
            continue
        # After a stall (a reconnect), go on at the rate instead of catching up in a burst.
        next_at = max(next_at + every, now - every)
        job_id = f"{args.id_prefix}-{n:06d}"
        n += 1
        ns = producer.parse_args(
            ["--job-id", job_id, "--budget-ms", str(args.budget_ms), "--prefix", args.prefix]
        )
        job = producer.build_envelope(ns, producer.now_ms())
        try:
            if channel is None or not channel.is_open:
                conn = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
                channel = conn.channel()
                channel.confirm_delivery()
            producer.publish_on(channel, args.prefix, job, producer.envelope_bytes(job), None)
            print(f"confirmed {job_id}", flush=True)
        except (producer.NotPublished, pika.exceptions.AMQPError, OSError) as e:
            print(f"failed {job_id} {e!r}"[:400].replace("\n", " "), flush=True)
            try:
                if conn is not None:
                    conn.close()
            except Exception:  # already closed by the broker
                pass
            conn = channel = None
    if conn is not None and conn.is_open:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
