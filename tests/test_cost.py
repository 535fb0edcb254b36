"""`hf_featcal.cost.measure_cost`: the peak RSS increase of a block is the memory the block touched at
its peak (a buffer of known size), not the process's earlier peak; seconds are the block's."""

from __future__ import annotations

import mmap
import time

import pytest

from hf_featcal.cost import measure_cost, rss_method

MIB = 2**20


@pytest.mark.skipif(rss_method() != "VmHWM", reason="the kernel's peak RSS cannot be reset here")
def _touched(size: int) -> mmap.mmap:
    """`size` bytes of fresh anonymous memory, every page written: mapped outside the C allocator, whose
    freed-but-kept memory (glibc's heap after an earlier test raised its thresholds) could hold them
    without a new page."""
    buffer = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        buffer[offset] = 1
    return buffer


def test_the_peak_is_the_blocks_own():
    _touched(256 * MIB).close()  # a 256 MiB peak before the block
    with measure_cost() as cost:
        _touched(48 * MIB).close()  # 48 MiB, every page touched
        time.sleep(0.05)
    assert 46 <= cost.peak_rss_mib <= 60, cost  # the block's 48 MiB, not the earlier 256
    assert 0.05 <= cost.seconds < 5 and cost.peak_cuda_mib is None
    with measure_cost() as idle:
        pass
    assert idle.peak_rss_mib < 4, idle


def test_a_block_that_raises_is_still_measured():
    with pytest.raises(RuntimeError), measure_cost() as cost:
        time.sleep(0.02)
        raise RuntimeError("boom")
    assert cost.seconds >= 0.02
