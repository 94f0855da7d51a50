"""A launched rank other than 0 has no engine of its own: building a client there is refused (it does not end the
process); ``start_client``, which every entry point uses, is where such a rank serves rank 0's engine."""

import pytest

from ember.config import EngineConfig
from ember.frontend import client as client_module
from ember.frontend.client import EngineClient, start_client


@pytest.fixture
def rank_1_of_2(monkeypatch):
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(name, value)
    return EngineConfig(tensor_parallel_size=2, distributed_executor_backend="launched")


def test_client_on_a_launched_rank_other_than_0_is_refused(rank_1_of_2):
    with pytest.raises(ValueError, match="rank 1 of a launched group has no engine of its own; start_client"):
        EngineClient(rank_1_of_2)


def test_start_client_serves_rank_0_there(rank_1_of_2, monkeypatch):
    served = []
    monkeypatch.setattr(client_module, "serve_launched", lambda resolved: served.append(resolved.parallel.rank))
    monkeypatch.setattr(client_module, "EngineClient", lambda config: "client")
    start_client(rank_1_of_2)
    assert served == [1]
