"""Logits processors applied before sampling, batched over the rows that need them.

- repetition_penalty: transformers semantics, over prompt and output tokens: a seen token's logit is divided by
  the penalty when positive and multiplied when negative;
- presence / frequency penalty: OpenAI semantics, over output tokens only: logit -= presence * (count > 0)
  + frequency * count;
- min_tokens: EOS and stop_token_ids are masked until that many tokens were generated.
"""

from __future__ import annotations

import torch


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool; penalty [B]."""
    p = penalty[:, None]
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """counts [B, V] of output tokens; presence/frequency [B]."""
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    for row, ids in enumerate(token_lists):
        if ids:
            t = torch.tensor(ids, dtype=torch.long, device=device)
            counts[row].index_add_(0, t, torch.ones(len(ids), device=device))
    return counts


def mask_tokens(logits: torch.Tensor, rows: list[int], token_lists: list[list[int]]) -> None:
    """Set the given tokens of the given rows to -inf, in place."""
    for row, ids in zip(rows, token_lists):
        valid = [i for i in ids if i < logits.shape[1]]
        if valid:
            logits[row, valid] = float("-inf")
