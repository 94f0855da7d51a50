"""The encoder as scheduled work (core/encoder_cache.py): a chunk is cut before the first image the step's budget
cannot encode, an image already held is free, encodings a step uses are never dropped in it, the least recently
used others go when the cache would pass its capacity."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.encoder_cache import EncoderCache
from ember.protocol import MultiModalInput, Placeholder


def _items(*spans: tuple[str, int, int]) -> list[MultiModalInput]:
    return [MultiModalInput(Placeholder(h, offset, length), {}) for h, offset, length in spans]


def test_a_chunk_stops_before_the_image_the_budget_cannot_encode():
    cache = EncoderCache(budget=20, capacity=40)
    cache.begin_step()
    items = _items(("a", 5, 16), ("b", 30, 16))
    assert cache.fit(items, 0, 60) == 30  # a fits (16 of 20), b does not: cut at b's start
    cache.schedule(items, 0, 30)
    assert [m.hash for m in cache.encode] == ["a"] and cache.left == 4
    cache.begin_step()
    assert cache.fit(items, 30, 30) == 30  # a new step's budget: b fits, a is held
    cache.schedule(items, 30, 30)
    assert [m.hash for m in cache.encode] == ["b"] and cache.encoded == 2


def test_a_held_image_is_free_and_a_chunk_starting_inside_an_unfit_image_waits():
    cache = EncoderCache(budget=20, capacity=40)
    cache.begin_step()
    cache.schedule(_items(("a", 0, 16)), 0, 16)
    assert cache.fit(_items(("a", 0, 16)), 0, 16) == 16  # held: costs nothing
    assert cache.fit(_items(("c", 10, 16)), 10, 16) == 0  # 4 left: the chunk starts in c, so it waits


def test_an_image_larger_than_a_whole_budget_runs_alone_in_a_fresh_step():
    cache = EncoderCache(budget=8, capacity=8)
    cache.begin_step()
    assert cache.fit(_items(("big", 0, 20)), 0, 8) == 8


def test_the_least_recently_used_encoding_goes_first_and_a_steps_own_never():
    cache = EncoderCache(budget=16, capacity=32)
    for h in ("a", "b"):
        cache.begin_step()
        cache.schedule(_items((h, 0, 16)), 0, 16)
    cache.begin_step()
    cache.schedule(_items(("a", 0, 16)), 0, 16)  # a used again: b is now the least recently used
    cache.schedule(_items(("c", 0, 16)), 0, 16)
    assert cache.free == ["b"] and list(cache.cached) == ["a", "c"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(1, 24), st.integers(0, 40)), min_size=1,
                max_size=30),
       st.integers(8, 32), st.integers(1, 3))
def test_mirror_invariants(steps, budget, factor):
    """Whatever is scheduled: a step never encodes more than its budget (unless one image alone is larger), the
    workers' view (encoded minus dropped) equals the mirror, and nothing a step uses is dropped in it."""
    cache = EncoderCache(budget, budget * factor)
    held: set[str] = set()
    sizes: dict[str, int] = {}
    for h, length, start in steps:
        length = sizes.setdefault(h, length)  # an image keeps its size
        cache.begin_step()
        items = _items((h, start, length))
        n = cache.fit(items, start, length)
        if n:
            cache.schedule(items, start, n)
        spent = sum(m.placeholder.length for m in cache.encode)
        assert spent <= budget or len(cache.encode) == 1
        assert not set(cache.free) & cache.step_hashes
        held |= {m.hash for m in cache.encode}
        held -= set(cache.free)
        assert held == set(cache.cached)
