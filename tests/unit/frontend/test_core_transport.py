"""Which transport an engine's core gets (``use_core_process``): the switch when set, else the device's default."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ember.errors import ConfigError
from ember.frontend.core_process import use_core_process


def _resolved(device: str, backend: str = "uni") -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(device=device), parallel=SimpleNamespace(backend=backend))


@pytest.mark.parametrize("device,backend,expected", [
    ("cpu", "uni", False), ("cpu", "mp", False),  # CPU: the thread (docs/architecture.md)
    ("cuda", "uni", True), ("cuda:1", "uni", True),  # CUDA: the process (docs/cuda.md)
    ("cuda", "mp", False), ("cuda", "ray", False), ("cuda", "launched", False),  # not measured / not possible
])
def test_unset_the_device_picks_the_transport(monkeypatch, device, backend, expected):
    monkeypatch.delenv("EMBER_ENGINE_CORE_PROCESS", raising=False)
    assert use_core_process(_resolved(device, backend)) is expected


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_switch_wins_over_the_device(monkeypatch, device):
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "1")
    assert use_core_process(_resolved(device, "mp")) is True
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "0")
    assert use_core_process(_resolved(device)) is False


def test_the_switch_is_refused_where_the_core_cannot_leave(monkeypatch):
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "1")
    with pytest.raises(ConfigError, match="'ray' executor"):
        use_core_process(_resolved("cuda", "ray"))
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "2")
    with pytest.raises(ConfigError, match="EMBER_ENGINE_CORE_PROCESS='2'"):
        use_core_process(_resolved("cpu"))
