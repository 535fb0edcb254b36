"""What one piece of work costs: wall-clock seconds and peak memory, as the compare grid reports them
per cell (`measure_cost`).

Peak memory is the increase of the process's peak resident set size (RSS) over its RSS when the work
started. On Linux the kernel keeps the peak (``VmHWM`` in ``/proc/self/status``) exactly, and writing
``5`` to ``/proc/self/clear_refs`` resets it to the current RSS: the reset at the start and the
reading at the end give the true peak of the interval, with no sampling gap and nothing added to the
work. Where that file cannot be written (another OS, a locked-down container) the RSS is sampled every
`SAMPLE_SECONDS` by a thread with psutil, if installed (a peak shorter than the interval can then be
missed); without either, the peak is not measured (None). On CUDA the peak of torch's allocator
(`torch.cuda.max_memory_allocated`, reset at the start) is reported beside it.

The reset moves the process's ``VmHWM`` (and ``ru_maxrss`` is untouched): a benchmark that reads the
process's lifetime peak must not run inside `measure_cost`.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["SAMPLE_SECONDS", "Cost", "measure_cost", "rss_method"]

#: how often the fallback sampler reads the RSS
SAMPLE_SECONDS = 0.005

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_MIB = 2**20


@dataclass
class Cost:
    """``seconds``: wall clock; ``peak_rss_mib``: the peak RSS increase over the RSS at the start, MiB
    (None: not measured); ``peak_cuda_mib``: the peak of torch's CUDA allocator over its allocation at the
    start, MiB (None: CUDA not in use)."""

    seconds: float = 0.0
    peak_rss_mib: float | None = None
    peak_cuda_mib: float | None = None


def _status_kib(field: str) -> int:
    with open(_STATUS, encoding="ascii") as handle:
        match = re.search(rf"^{field}:\s+(\d+) kB", handle.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"{_STATUS} has no {field}")
    return int(match.group(1))


def _reset_peak() -> bool:
    """Reset the kernel's peak RSS of this process to its current RSS; False where that is not possible."""
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as handle:
            handle.write("5")
        _status_kib("VmHWM")
    except OSError:
        return False
    return True


def rss_method() -> str:
    """How `measure_cost` measures the peak RSS here: "VmHWM" (kernel peak, reset per interval),
    "psutil sampling" or "none"."""
    if _reset_peak():
        return "VmHWM"
    try:
        import psutil  # noqa: F401
    except ImportError:
        return "none"
    return "psutil sampling"


class _Sampler(threading.Thread):
    """Reads the process's RSS every `SAMPLE_SECONDS` and keeps the largest value (bytes)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import psutil

        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, self.process.memory_info().rss)


def _cuda() -> object | None:
    """torch.cuda when torch is loaded and CUDA has been initialised (nothing is loaded for it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda


@contextlib.contextmanager
def measure_cost() -> Iterator[Cost]:
    """Yield a `Cost` filled in when the block ends (also when it raises): its seconds, its peak RSS
    increase and, on CUDA, its peak allocator increase (the module docstring says how)."""
    cost = Cost()
    cuda = _cuda()
    cuda_start = 0
    if cuda is not None:
        cuda.synchronize()  # type: ignore[attr-defined]
        cuda.reset_peak_memory_stats()  # type: ignore[attr-defined]
        cuda_start = cuda.memory_allocated()  # type: ignore[attr-defined]
    sampler: _Sampler | None = None
    exact = _reset_peak()
    if exact:
        start_kib = _status_kib("VmRSS")
    else:
        with contextlib.suppress(ImportError):
            sampler = _Sampler()
            start_bytes = sampler.peak
            sampler.start()
    start = time.perf_counter()
    try:
        yield cost
    finally:
        if cuda is not None:
            cuda.synchronize()  # type: ignore[attr-defined]
            cost.peak_cuda_mib = (cuda.max_memory_allocated() - cuda_start) / _MIB  # type: ignore[attr-defined]
        cost.seconds = time.perf_counter() - start
        if exact:
            cost.peak_rss_mib = max(0, _status_kib("VmHWM") - start_kib) / 1024
        elif sampler is not None:
            sampler.done.set()
            sampler.join()
            cost.peak_rss_mib = max(0, sampler.peak - start_bytes) / _MIB
