"""``Layer`` keeps its sublayers and parameters in the instance ``__dict__`` as well as torch's registry (a plain
attribute read in every forward): every change made through attributes keeps the two the same."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from ember.layers.base import Layer


class _Two(Layer):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.weight = nn.Parameter(torch.ones(2))
        self.register_buffer("table", torch.zeros(1))


def _same(layer: _Two) -> None:
    for name in ("proj", "weight"):
        registry = layer._modules if name == "proj" else layer._parameters
        assert getattr(layer, name) is registry.get(name), name


def test_reads_come_from_the_instance_and_match_the_registry():
    layer = _Two()
    assert layer.__dict__["proj"] is layer._modules["proj"] and layer.__dict__["weight"] is layer._parameters["weight"]
    assert sorted(layer.state_dict()) == ["proj.bias", "proj.weight", "table", "weight"]
    _same(layer)


def test_reassigning_clearing_and_deleting_keep_them_in_step():
    layer = _Two()
    layer.proj = nn.Linear(3, 3)
    layer.weight = nn.Parameter(torch.zeros(3))
    _same(layer)
    assert layer.proj.in_features == 3 and layer.weight.shape == (3,)
    layer.proj, layer.weight = None, None  # a registered slot set to None reads None
    assert layer.proj is None and layer.weight is None and "proj" not in layer.__dict__
    layer.proj = nn.Linear(1, 1)
    del layer.proj, layer.weight
    assert not hasattr(layer, "proj") and not hasattr(layer, "weight")
    assert "proj" not in layer.state_dict() and "weight" not in layer.state_dict()


def test_copies_and_conversions_read_their_own_sublayers():
    for other in (copy.deepcopy(_Two()), pickle.loads(pickle.dumps(_Two())), _Two().to(torch.float64)):
        _same(other)
    converted = _Two().to(torch.float64)
    assert converted.weight.dtype == torch.float64 and converted.proj.weight.dtype == torch.float64
