"""What the bench measures about the machine: copy bandwidth, CPU taken by other processes, RSS, versions."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np

from qspec import __version__

CONTENTION_NOTE = 0.1  # other processes' CPU share above which the report says the machine was shared


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second a numpy copy of a large array moves (read + write, best of ``repeats``)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - begin)
    return 2 * src.nbytes / best


def rss_mb() -> float:
    """This process's resident set now, in MB."""
    import psutil

    return psutil.Process().memory_info().rss / 1e6


def peak_rss_mb() -> float:
    """This process's peak resident set: ``VmHWM`` (not ``ru_maxrss``, which a child inherits across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6  # kB (KiB) -> MB, as rss_mb
    except OSError:  # pragma: no cover - not Linux
        pass
    return rss_mb()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class CpuMeter:
    """Share of the machine's CPU that *other* processes used over an interval.

    ``(system busy CPU s - this process tree's CPU s) / (wall s x cores)``: 0 on a quiet machine,
    0.5 when another job kept one of two cores busy. The tree is this process, its live children
    (the transformers worker) and the children it has waited for (the memory probes).
    """

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.cores = psutil.cpu_count() or 1
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        t = self._psutil.cpu_times()
        # Steal: time the hypervisor gave this VM's CPUs to someone else, contention all the same.
        busy = t.user + t.nice + t.system + sum(getattr(t, f, 0.0) for f in ("irq", "softirq", "steal"))
        me = self._psutil.Process()
        own = sum(me.cpu_times()[:4])  # user, system, children_user, children_system
        for child in me.children(recursive=True):
            try:
                own += sum(child.cpu_times()[:2])
            except self._psutil.Error:  # exited between the listing and the read
                pass
        return time.perf_counter(), busy, own

    def restart(self) -> None:
        self._start = self._sample()

    def other_share(self) -> float:
        """Other processes' share since the start (or the last ``restart``), clipped to [0, 1]."""
        now, busy, own = self._sample()
        wall, busy0, own0 = now - self._start[0], self._start[1], self._start[2]
        if wall <= 0:
            return 0.0
        return round(min(1.0, max(0.0, (busy - busy0 - (own - own0)) / (wall * self.cores))), 3)


def machine_versions() -> dict[str, str]:
    """Versions of what runs qspec's side of the bench."""
    import onnxruntime

    return {
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "qspec": __version__,
    }
