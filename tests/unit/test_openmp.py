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


def test_the_lookup_reads_paths_with_spaces_and_prefers_torchs_libgomp():
    """A mapped file's path is the line's sixth field whole; where another package brought its own libgomp
    (scikit-learn's wheels do), the pause is torch's."""
    line = "7f00-7f10 r-xp 00000000 08:01 42    /opt/my libs/libgomp.so.1 (deleted)\n"
    assert openmp._mapped_path(line) == "/opt/my libs/libgomp.so.1"
    torch_lib = os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib", "libgomp.so.1")
    other = "/site-packages/scikit_learn.libs/libgomp-e985bcbb.so.1.0.0"
    assert sorted([other, torch_lib], key=openmp._torch_first) == [torch_lib, other]
    pytest.importorskip("sklearn.metrics")  # maps scikit-learn's libgomp where its wheel carries one
    import ctypes

    with open("/proc/self/maps", encoding="utf-8") as f:
        mapped = {openmp._mapped_path(line) for line in f if "/libgomp" in line}
    ours = [p for p in mapped if not openmp._torch_first(p)[0]]
    if not ours or len(mapped) < 2:
        pytest.skip("no second libgomp mapped beside torch's")
    fn = openmp._lookup()
    want = ctypes.CDLL(ours[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
    assert ctypes.cast(fn, ctypes.c_void_p).value == ctypes.cast(want, ctypes.c_void_p).value
