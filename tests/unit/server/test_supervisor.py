"""The engine supervisor without an engine: stopped clients are replaced (adapters added again, the restart counted),
restarts are bounded in their window, a start that keeps failing is tried ATTEMPTS times, and a server that is
shutting down is left alone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from ember.lora.request import LoRARequest
from ember.server import supervisor as sv
from ember.server.supervisor import EngineSupervisor


class FakeClient:
    def __init__(self) -> None:
        self.alive, self.stopped, self.loras = True, False, []

    def is_alive(self) -> bool:
        return self.alive

    def stop_reason(self) -> str | None:
        return None if self.alive else "rank 1 exited with code -9"

    def shutdown(self) -> None:
        self.stopped = True

    def add_lora(self, lora: LoRARequest) -> bool:
        self.loras.append(lora)
        return True


class Counted:
    def __init__(self) -> None:
        self.restarts: list[str] = []

    def engine_restarted(self, name: str) -> None:
        self.restarts.append(name)


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(sv, "POLL_S", 0.001)
    monkeypatch.setattr(sv, "PAUSE_S", 0.001)


def _engine(client: FakeClient) -> SimpleNamespace:
    return SimpleNamespace(name="tiny", client=client, admission=SimpleNamespace(closed=False), restarting=False)


def test_a_stopped_engine_is_replaced_with_its_adapters_until_the_bound(caplog):
    first, started = FakeClient(), []

    def start() -> FakeClient:
        started.append(FakeClient())
        return started[-1]
    engine, metrics = _engine(first), Counted()
    lora = LoRARequest("a0", 1, "/adapters/a0")
    sup = EngineSupervisor(engine, start, [lora], metrics, max_restarts=2)

    async def run() -> None:
        watch = asyncio.create_task(sup.watch())
        for _ in range(3):  # three stops: two restarts, then the bound
            engine.client.alive = False
            for _ in range(200):
                await asyncio.sleep(0.005)
                if engine.client.alive or sup.gave_up:
                    break
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(run())
    assert len(started) == 2 and engine.client is started[-1] and first.stopped and started[0].stopped
    assert all(c.loras == [lora] for c in started) and metrics.restarts == ["tiny", "tiny"]
    assert sup.gave_up and not engine.restarting
    assert "rank 1 exited with code -9" in caplog.text and "is not restarted" in caplog.text
    sup.close()
    assert started[1].stopped


def test_a_start_that_keeps_failing_is_tried_a_bounded_number_of_times(caplog):
    engine, calls = _engine(FakeClient()), []

    def start() -> FakeClient:
        calls.append(1)
        raise RuntimeError("out of memory")
    sup = EngineSupervisor(engine, start, [], Counted(), max_restarts=5)
    engine.client.alive = False
    asyncio.run(sup.restart())
    assert len(calls) == sv.ATTEMPTS and sup.gave_up and not engine.restarting
    assert "could not be started again" in caplog.text


def test_a_server_shutting_down_is_not_restarted():
    engine = _engine(FakeClient())
    engine.client.alive, engine.admission.closed = False, True
    sup = EngineSupervisor(engine, FakeClient, [], Counted(), max_restarts=3)

    async def run() -> None:
        watch = asyncio.create_task(sup.watch())
        await asyncio.sleep(0.05)
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(run())
    assert not engine.client.stopped and not sup.recent


def test_an_adapter_that_no_longer_loads_does_not_stop_the_restart(caplog):
    """One of the served adapters' folders is gone by the time the engine restarts: the engine serves without it
    (its requests fail one by one) rather than staying down."""
    from ember.errors import BadRequestError

    class NoAdapter(FakeClient):
        def add_lora(self, lora: LoRARequest) -> bool:
            if lora.lora_name == "gone":
                raise BadRequestError(f"lora adapter {lora.lora_path}: no such folder")
            return super().add_lora(lora)

    engine = _engine(FakeClient())
    loras = [LoRARequest("gone", 1, "/adapters/gone"), LoRARequest("a1", 2, "/adapters/a1")]
    sup = EngineSupervisor(engine, NoAdapter, loras, Counted(), max_restarts=3)
    engine.client.alive = False
    asyncio.run(sup.restart())
    assert isinstance(engine.client, NoAdapter) and engine.client.alive and not sup.gave_up
    assert [lora.lora_name for lora in engine.client.loras] == ["a1"] and "could not be loaded again" in caplog.text
