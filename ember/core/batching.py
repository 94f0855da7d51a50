"""The scheduler's choice for a step, written as the worker's ``BatchDescription``: one flat ragged batch,
decode rows first, then prefill chunks; which rows are sampled and which score prompt tokens."""

from __future__ import annotations

from ember.core.lora_slots import LoRASlots
from ember.core.request import Sequence
from ember.core.scheduler import ScheduledBatch
from ember.core.window import KVWindow
from ember.protocol import BatchDescription, PrefillChunk, PromptLogprobsRows, SamplingRow


def describe(batch: ScheduledBatch, block_size: int, released: list[int], window: KVWindow | None = None,
             loras: LoRASlots | None = None) -> tuple[BatchDescription, list[Sequence]]:
    """The description, and the sequences that sample a token (aligned with its sampling rows). Under a KV window
    positions map to ring slots and a decode reads the filled slots only. With LoRA every row names its adapter's
    slot (-1: the base model), and adapters the scheduler just made resident are loaded first."""
    d = BatchDescription(copies=batch.copies, released=released)
    ids, positions, slots, bs = d.input_ids, d.positions, d.slots, block_size
    adapted = loras is not None and any(s.request.lora_id for s in batch.seqs)
    if adapted:
        d.lora_slots, d.lora_loads = [], loras.take_loads()
    sampled: list[Sequence] = []
    for i in sorted(range(len(batch)), key=lambda i: batch.num_tokens[i] != 1):  # decodes first
        seq, n = batch.seqs[i], batch.num_tokens[i]
        start, c = len(ids), seq.num_computed_tokens
        ids.extend(seq.token_ids[c:c + n])
        positions.extend(range(c, c + n))
        if adapted:
            d.lora_slots.extend([loras.slot_of(seq.request.lora_id) if seq.request.lora_id else -1] * n)
        table = seq.block_table
        where = range(c, c + n) if window is None else [window.slot(p) for p in range(c, c + n)]
        slots.extend(table[p // bs] * bs + p % bs for p in where)
        if n == 1:
            d.decode_block_tables.append(table)
            d.decode_context_lens.append(c + 1 if window is None else window.kept(c + 1))
        else:
            d.prefills.append(PrefillChunk(start, n, c + n, table))
        req = seq.request
        if c + n == seq.num_tokens:
            p = req.params
            history = SamplingRow.reads_history(p)
            d.sample_rows.append(start + n - 1)
            d.sampling.append(SamplingRow(seq.seq_id, p, req.seed_of(seq), seq.num_output_tokens,
                                          seq.token_ids if history else None, seq.num_prompt_tokens))
            sampled.append(seq)
        if seq.index == 0 and req.wants_prompt_logprobs and c < seq.num_prompt_tokens:
            # rows at positions c..end-1 predict prompt tokens c+1..end
            end = min(c + n, seq.num_prompt_tokens - 1)
            d.prompt_logprobs.append(PromptLogprobsRows(seq.seq_id, start, seq.token_ids[c + 1:end + 1],
                                                        req.params.prompt_logprobs))
    return d, sampled
