"""``ember.openmp.release_pool``: the calling thread's OpenMP worker threads go (they would keep an engine's
parallel regions waking sleeping workers: ember/openmp.py), and come back at its next parallel region."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ember import openmp


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_release_pool_frees_the_calling_threads_workers():
    openmp.release_pool()  # looks libgomp up (torch has loaded it)
    if not openmp._pause:
        pytest.skip("torch's OpenMP here is not a libgomp with omp_pause_resource_all")
    counts = []
    threads = torch.get_num_threads()

    def work() -> None:
        torch.set_num_threads(2)  # a pool of at least one worker, whatever the suite runs with (tests/conftest.py)
        counts.append(_threads())
        x = torch.ones(1 << 22)  # a parallel region: this thread gets a pool of workers
        counts.append(_threads())
        openmp.release_pool()
        counts.append(_threads())
        x.add_(1)
        counts.append(_threads())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    torch.set_num_threads(threads)
    before, with_pool, released, again = counts
    assert with_pool > before and released == before and again == with_pool
