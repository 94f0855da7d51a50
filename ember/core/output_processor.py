"""After a step: append each sampled token to its sequence, record logprobs, detokenize, decide whether it stops."""

from __future__ import annotations

import time

import torch

from ember.core.sequence import Sequence, SequenceStatus
from ember.layers.sampler import TokenLogprobs
from ember.outputs import Logprob, PositionLogprobs
from ember.tokenizer import Tokenizer


def _position_logprobs(tokenizer: Tokenizer, token: int, lp: float, rank: int, top_ids: list[int],
                       top_lps: list[float]) -> PositionLogprobs:
    out = {token: Logprob(lp, rank, tokenizer.decode([token], skip_special_tokens=False))}
    for r, (t, v) in enumerate(zip(top_ids, top_lps), start=1):
        if t not in out:
            out[t] = Logprob(v, r, tokenizer.decode([t], skip_special_tokens=False))
    return out


def append_token(seq: Sequence, token: int, lp: TokenLogprobs | None, tokenizer: Tokenizer,
                 max_model_len: int) -> bool:
    """Add a sampled token; return True when the sequence has finished."""
    params = seq.request.params
    seq.token_ids.append(token)
    seq.new_token_ids.append(token)
    metrics = seq.request.metrics
    if metrics.first_token_time is None:
        metrics.first_token_time = time.time()
    if lp is not None:
        seq.cumulative_logprob += lp.logprob
        seq.new_logprobs.append(_position_logprobs(tokenizer, token, lp.logprob, lp.rank, lp.top_ids,
                                                   lp.top_logprobs))
    n_out = seq.num_output_tokens
    may_stop = n_out >= params.min_tokens
    stop_str = seq.detokenizer.add(token, check_stop=may_stop) if seq.detokenizer is not None else None
    reason: str | None = None
    if may_stop and not params.ignore_eos and token in params.eos_token_ids:
        reason, seq.stop_reason = "stop", None
    elif may_stop and token in params.stop_token_ids:
        reason, seq.stop_reason = "stop", token
    elif may_stop and (stop_seq := _ended_by(seq, params.stop_token_sequences)) is not None:
        reason, seq.stop_reason = "stop", stop_seq
    elif stop_str is not None:
        reason, seq.stop_reason = "stop", stop_str
    elif (params.max_tokens is not None and n_out >= params.max_tokens) or seq.num_tokens >= max_model_len:
        reason = "length"
    if reason is None:
        return False
    if stop_str is None and seq.detokenizer is not None:
        seq.detokenizer.flush_incomplete()
    seq.finish_reason = reason
    seq.status = SequenceStatus.FINISHED
    return True


def _ended_by(seq: Sequence, sequences: list[list[int]]) -> list[int] | None:
    """The first stop token sequence the output now ends with, or None."""
    out = seq.output_token_ids
    for stop in sequences:
        if len(out) >= len(stop) and out[len(out) - len(stop):] == stop:
            return stop
    return None


def prompt_logprobs(tokenizer: Tokenizer, logprobs: torch.Tensor, prompt_ids: list[int],
                    k: int) -> list[PositionLogprobs | None]:
    """Logprob of each given prompt token from the row before it, plus the top k (rows and ids aligned)."""
    out: list[PositionLogprobs | None] = []
    if logprobs.shape[0] == 0:
        return out
    ids = torch.tensor(prompt_ids, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1)
    ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    for i, (t, v) in enumerate(zip(prompt_ids, chosen.tolist())):
        out.append(_position_logprobs(tokenizer, t, v, ranks[i], top_ids[i].tolist() if k else [],
                                      top_vals[i].tolist() if k else []))
    return out
