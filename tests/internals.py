"""What tests that look inside an engine reach through, in one place: the engine core and rank 0's worker of an
engine running in this process (``LLM``, ``AsyncLLM`` or an ``EngineClient``). Front ends never use these: the
client's door is ``ember.frontend.client.EngineClient``."""

from __future__ import annotations

from typing import Any


def core_of(engine: Any):
    """The ``EngineCore`` behind an in-process engine."""
    client = getattr(engine, "client", engine)
    return client._loop.core


def worker_of(engine: Any):
    """Rank 0's ``Worker`` (in this process for every executor)."""
    return core_of(engine).executor._worker


def oracle_drafts(monkeypatch: Any, prompts: list[list[int]], outputs: list[list[int]], vocab: int = 49152) -> None:
    """Speculative decoding's drafts from known answers (a random model copies nothing, so n-gram lookup would
    rarely draft): from a sequence on the path of one of ``outputs``, the answer's next tokens with every third
    position replaced by a wrong token (an id below vocab), so drafts are kept whole, in part and not at all;
    elsewhere no draft. Every decoding row drafts what it can (drafts cost nothing to the speculator's cost
    model)."""
    import ember.core.speculator as speculator
    from ember.core.ngram import NgramIndex

    def propose(self, context: list[int], k: int) -> list[int]:
        for p, out in zip(prompts, outputs):
            if context[:len(p)] == p and context[len(p):] == out[:len(context) - len(p)]:
                i = len(context) - len(p)
                return [t if (i + j) % 3 != 2 else (t + 1) % vocab for j, t in enumerate(out[i:i + k])]
        return []

    monkeypatch.setattr(NgramIndex, "propose", propose)
    monkeypatch.setattr(speculator, "verify_extra", lambda k, costs=None: 0.0)
