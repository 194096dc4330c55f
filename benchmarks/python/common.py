"""Timing and reporting shared by the Python benchmarks."""

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

import moeext


@dataclass
class Row:
    op: str                 # moeext op measured
    case: str               # shape / preset, human readable
    moeext_s: float         # median seconds per call
    baseline: str           # what users run today, measured in the same run
    baseline_s: float
    x: Optional[float] = None  # plot abscissa (tokens), when the row belongs to a series
    # Where the two were timed in turns: the median and quartiles of the rounds' time ratios.
    ratio_in_rounds: Optional[Tuple[float, float, float]] = None

    @property
    def speedup(self) -> float:
        return self.baseline_s / self.moeext_s

    def line(self) -> str:
        return (f"{self.op:20s} {self.case:34s} moeext {self.moeext_s * 1e6:11.1f} us   "
                f"{self.baseline:22s} {self.baseline_s * 1e6:11.1f} us   x{self.speedup:6.1f}")


def median_seconds(fn, min_time=0.3, max_samples=2000, batch_time=20e-6):
    """Median seconds per call after a warm-up: at least 5 samples, about min_time in all.

    Calls shorter than batch_time are timed in batches of back-to-back calls, one sample per
    batch, so that the ~0.1 us of reading the clock and keeping the sample is not counted
    as part of a call that takes 1 us.
    """
    for _ in range(3):
        fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    batch = max(1, min(1000, int(batch_time / once)))
    samples_wanted = int(min(max_samples, max(5, min_time / (once * batch))))
    samples = []
    for _ in range(samples_wanted):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"moeext CPU path {moeext.cpu_isa()}")
