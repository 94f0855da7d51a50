"""Owns the model and the KV cache tensors; turns a scheduled batch into one flat forward pass and samples.

Input preparation is plain Python lists turned into tensors once per step: token ids, positions, slot of every
token, and the attention metadata (decode rows first, then prefill spans).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ember.config import EngineConfig
from ember.core.scheduler import ScheduledBatch
from ember.core.sequence import Sequence
from ember.kernels import kernels_for
from ember.layers.attention import AttentionMetadata, PrefillSpan
from ember.layers.sampler import Sampler, SamplerOutput
from ember.model_loader import LoadedModel

logger = logging.getLogger("ember")


@dataclass(slots=True)
class StepOutput:
    sampled: list[Sequence]  # sequences that produced a token this step
    sampler: SamplerOutput | None
    # seq_id -> (log_softmax rows, the prompt tokens they predict, position of the chunk's first token)
    prompt_logprobs: dict[int, tuple[torch.Tensor, list[int], int]]


def kv_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    cfg = loaded.hf_config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * block_size * heads * head_dim * torch.finfo(loaded.dtype).bits // 8


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> None:
        self.config = config
        self.model = loaded.model
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        per_block = kv_bytes_per_block(loaded, self.block_size)
        budget = config.kv_cache_bytes()
        blocks_per_seq = -(-max_model_len // self.block_size)
        self.num_blocks = min(budget // per_block, blocks_per_seq * config.max_num_seqs)
        if self.num_blocks < blocks_per_seq:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds {budget // per_block * self.block_size} tokens of KV, "
                f"less than one sequence of max_model_len={max_model_len}: raise kv_cache_memory to at least "
                f"{blocks_per_seq * per_block} bytes or lower max_model_len")
        cfg = loaded.hf_config
        layers = self.model.attention_layers()
        first = layers[0]
        # zeros, not empty: padded decode batches read unused slots, and NaN garbage there would survive the mask
        self.kv_cache = torch.zeros(2, len(layers), self.num_blocks, self.block_size, first.num_kv_heads,
                                    first.head_dim, dtype=loaded.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.sampler = Sampler(cfg.vocab_size)
        kernels_for(self.device)  # compile (first run on this machine) or load the CPU kernels now, not mid-step
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[Sequence],
                                                       list[int], dict[int, tuple[int, list[int], int]]]:
        order = sorted(range(len(batch)), key=lambda i: batch.num_tokens[i] != 1)  # decodes first
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_rows: dict[int, tuple[int, list[int], int]] = {}
        for i in order:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            start, c = len(ids), seq.num_computed_tokens
            ids.extend(seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(c + 1)
            else:
                prefills.append(PrefillSpan(start, n, c + n, torch.tensor(table, dtype=torch.long, device=self.device)))
            if c + n == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(start + n - 1)
            if seq.index == 0 and seq.request.wants_prompt_logprobs and c < seq.num_prompt_tokens:
                # rows at positions c..end-1 predict prompt tokens c+1..end
                end = min(c + n, seq.num_prompt_tokens - 1)
                prompt_rows[seq.seq_id] = (start, seq.token_ids[c + 1:end + 1], c)
        dev = self.device
        nd = len(decode_tables)
        tables_t = lens_t = None
        if nd:
            width = max(len(t) for t in decode_tables)
            tables_t = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=dev)
            lens_t = torch.tensor(decode_lens, dtype=torch.long, device=dev)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), nd, tables_t, lens_t, prefills)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_seqs, sample_rows, prompt_rows)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        ids, positions, meta, sample_seqs, sample_rows, prompt_rows = self._prepare(batch)
        hidden = self.model(ids, positions, meta)
        sampled = None
        if sample_seqs:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            sampled = self.sampler(logits, sample_seqs)
        prompt_lps = {}
        for seq_id, (start, targets, first) in prompt_rows.items():
            logprobs = self.model.compute_logits(hidden[start:start + len(targets)]).log_softmax(dim=-1)
            prompt_lps[seq_id] = (logprobs, targets, first)
        return StepOutput(sample_seqs, sampled, prompt_lps)
