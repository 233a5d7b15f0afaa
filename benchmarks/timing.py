"""Interleaved timing and peak-memory sampling for the benchmark runner.

Mental model: on a shared, noisy machine only ratios measured side by side
mean anything. So every repeat runs every method once (the baseline
included), in an order rotated by one each repeat, and a method's ratio is
``median(method) / median(baseline)`` with the ``[min, max]`` of the
per-repeat paired ratios beside it. A method may run fewer repeats than
the baseline (a slow one, at the longest length); it is paired with the
baseline of the repeats it ran in. ``setup``/``teardown`` (routing a
family, a flag) and freeing a method's result stay outside the timed region.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Method:
    name: str
    run: Callable[[], Any]
    reps: int | None = None  # at most this many repeats (None: every repeat)
    setup: Callable[[], Any] | None = None
    teardown: Callable[[], Any] | None = None
    times: dict = field(default_factory=dict)  # repeat -> seconds

    def once(self) -> float:
        if self.setup is not None:
            self.setup()
        try:
            gc.collect()
            start = time.perf_counter()
            result = self.run()
            elapsed = time.perf_counter() - start
            del result
        finally:
            if self.teardown is not None:
                self.teardown()
        return elapsed


def interleave(methods: list, repeats: int, log: Callable[[str], None] = print) -> None:
    """Run every method ``repeats`` times (fewer where ``Method.reps`` says), rotated each repeat."""
    for rep in range(repeats):
        order = methods[rep % len(methods):] + methods[: rep % len(methods)]
        for method in order:
            if method.reps is not None and len(method.times) >= method.reps:
                continue
            method.times[rep] = method.once()
        log(f"    repeat {rep + 1}/{repeats}: " + ", ".join(f"{m.name} {m.times[rep]:.3f}s" for m in methods if rep in m.times))


def summary(method: Method, base: Method) -> dict:
    """Ratio of medians to ``base`` and the paired ``[min, max]``, with the absolute medians (seconds)."""
    paired = [method.times[rep] / base.times[rep] for rep in method.times if rep in base.times]
    median, base_median = statistics.median(method.times.values()), statistics.median(base.times.values())
    return {
        "ratio": median / base_median,
        "min": min(paired),
        "max": max(paired),
        "median_s": median,
        "min_s": min(method.times.values()),
        "max_s": max(method.times.values()),
        "n": len(method.times),
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def peak_rss(run: Callable[[], Any], interval: float = 0.002) -> tuple[int, Any]:
    """``(peak RSS above the RSS before, result)`` of one call, sampled from a thread every ``interval`` s."""
    gc.collect()
    before = rss_bytes()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = run()
    finally:
        done.set()
        thread.join()
    peak[0] = max(peak[0], rss_bytes())
    return peak[0] - before, result
