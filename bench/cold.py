"""One review in-process, back to back and after the process has been idle: what a review costs when it
reaches a worker that has waited for it, as every review does at concurrency 1 (docs/performance.md).
Run: `python bench/cold.py`.

The review is a small route-1 CREATE (JSON decode, the core, the answer encoded), as the server's review
path runs them. Each condition is timed over `-n` reviews (medians, wall clock) and printed as a ratio of
the back-to-back one, measured in the same run: back to back; after a sleep of 0.5 ms and of 5 ms; after
5 ms of a busy loop that touches no memory; after writing 4 MiB and 48 MiB of memory (one byte a cache
line, no sleep). Each row also gives the core's share (`Admission.review`: the rules and the patch; the
rest is the JSON, which bench/baseline.py --patch does too) and how long the process was away.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402

from tests.helpers import ROUTE1, review, settings, stock_runtimes, trainjob  # noqa: E402
from webhook.core.admission import MUTATE, Admission  # noqa: E402
from webhook.serving import codec  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=300, help="reviews per condition (default 300)")
    args = p.parse_args()
    admission = Admission(settings(ROUTE1), stock_runtimes())
    body = orjson.dumps(review(trainjob()))
    memory = bytearray(48 << 20)

    def write(size: int):
        ones = b"\x01" * (size // 64)
        return lambda: memory.__setitem__(slice(0, size, 64), ones)  # one byte a cache line

    def spin():
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass

    conditions = {"back to back": lambda: None, "after a 0.5 ms sleep": lambda: time.sleep(0.0005),
                  "after a 5 ms sleep": lambda: time.sleep(0.005), "after 5 ms of a busy loop": spin,
                  "after writing 4 MiB": write(4 << 20), "after writing 48 MiB": write(48 << 20)}

    def one() -> tuple[int, int]:
        started = time.perf_counter_ns()
        doc = codec.loads(body)
        decoded = time.perf_counter_ns()
        answer, _ = admission.review(doc, MUTATE)
        reviewed = time.perf_counter_ns()
        codec.dumps(answer)
        return time.perf_counter_ns() - started, reviewed - decoded

    for _ in range(200):
        one()
    print(f"# A review after idling, {date.today()}, {platform.machine()}, Python {platform.python_version()}, "
          f"{len(body)}-byte review, median of {args.n}, load average {os.getloadavg()[0]:.2f}\n")
    print("| before each review | away ms | review µs | / back to back | of it, the core µs |\n"
          "|---|---:|---:|---:|---:|")
    warm = None
    for label, before in conditions.items():
        away, whole, core = [], [], []
        for _ in range(args.n):
            started = time.perf_counter_ns()
            before()
            away.append(time.perf_counter_ns() - started)
            w, c = one()
            whole.append(w)
            core.append(c)
        us = statistics.median(whole) / 1000
        warm = warm or us
        print(f"| {label} | {statistics.median(away) / 1e6:.2f} | {us:.0f} | {us / warm:.1f}× | "
              f"{statistics.median(core) / 1000:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
