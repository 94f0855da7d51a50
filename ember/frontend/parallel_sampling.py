"""n > 1 in the front end (as vLLM's ``parallel_sampling``): a request for n samples goes to the engine core as n
requests of one sample each, and their outputs come back together as the parent's samples 0..n-1.

Child i keeps the parent's parameters with n = 1 and seed + i (so a seeded request draws what it drew when the core
forked samples itself); only child 0 scores the prompt (prompt_logprobs). The children name their parent as
``prefix_group``: the core starts child 0 first and the others once its prompt's full blocks are in the KV cache,
which they then share (through the prefix cache, also when prefix caching is off for other requests). Beam search
stays one core request: its beams are ranked together every step.
"""

from __future__ import annotations

from dataclasses import replace

from ember.protocol import EngineRequest


def child_id(request_id: str, index: int) -> str:
    """The core's id of sample ``index`` of a request fanned out."""
    return f"{request_id}#{index}"


def fan_out(record: EngineRequest) -> list[EngineRequest]:
    """The core requests of one front-end request: itself when it asks for one sample (or beams), else n children."""
    p = record.params
    if p.n == 1 or p.use_beam_search:
        return [record]
    children = []
    for i in range(p.n):
        params = p.clone(n=1, seed=None if p.seed is None else p.seed + i,
                         prompt_logprobs=p.prompt_logprobs if i == 0 else None)
        children.append(replace(record, request_id=child_id(record.request_id, i), params=params,
                                prefix_group=record.request_id))
    return children
