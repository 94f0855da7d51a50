"""The model runner: turns each ``SchedulerOutput`` into one forward pass and sampled tokens. It holds what the
messages no longer repeat: the sequences' tokens and blocks (``InputBatch``), a block-table tensor written in place
as blocks arrive, and the samples' sampling state (generators, penalty counts) until they finish.

Split over ranks, every rank's runner gets the same messages and holds the same sequences. A rank runs its stage's
layers on its heads; with several pipeline stages the batch goes through in micro-batches (``micro_batches``), so
stage s works on micro-batch m + 1 while stage s + 1 works on m. Only the sampling rank (TP rank 0 of the last
stage) gathers the logits and samples, and only it keeps sampling state.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.config import LoRAConfig
from ember.distributed import ParallelContext, comm
from ember.errors import EmberError
from ember.layers.attention import AttentionMetadata, PrefillSpan
from ember.layers.logits_processors import RowState
from ember.layers.lora import LoRABatch
from ember.layers.sampler import Sampler, rank_logprobs
from ember.lora.adapter import module_name, read_adapter
from ember.model_loader import LoadedModel
from ember.protocol import DRAFT_PLACEHOLDER, KVWindow, LoRALoad, SchedulerOutput, WorkerOutput
from ember.worker.drafter import Drafter
from ember.worker.input_batch import InputBatch, StepRows
from ember.worker.pooler import Pooler


def micro_batches(num_tokens: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` row ranges of the flat batch, as equal as rows allow. A range may end inside a prefill chunk: the
    chunk's second part runs after its first on every stage, so it finds the first part's K/V in the cache, as
    chunked prefill does."""
    cuts = [num_tokens * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, device: torch.device, block_size: int, parallel: ParallelContext,
                 seed: int, lora: LoRAConfig | None = None, window: KVWindow | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        self.parallel = parallel
        self.lora = lora
        self.batch = InputBatch(block_size, window, mrope=bool(getattr(self.model, "mrope", False)))
        self.tables = torch.zeros(8, 16, dtype=torch.long)  # row -> block ids (host); grows on demand
        self.sampler = Sampler(loaded.shape.vocab_size, seed=seed)
        self.states: dict[int, RowState] = {}  # sample handle -> its sampling state, until it finishes
        self.graphs: Any = None  # CUDA: the decode step's graphs (``cuda_graph.DecodeGraphs``), set at start-up
        self.drafter: Drafter | None = None  # speculative decoding's draft model (the worker sets it)
        self.pooler = Pooler()  # pooling requests' chunks pooled so far
        # a vision-language model's image encodings by content hash, kept until the core drops them (its
        # ``EncoderCache`` mirrors this dict)
        self.encodings: dict[str, torch.Tensor] = {}

    # --- the persistent block table ---
    def _write_tables(self) -> None:
        """Apply the block-table changes of this step's message (new sequences' tables, blocks appended)."""
        writes = self.batch.take_table_writes()
        if not writes:
            return
        r, c = self.tables.shape
        need_r = self.batch.num_rows
        need_c = max(col + len(ids) for _, col, ids in writes)
        if need_r > r or need_c > c:  # grow by doubling: rarely, and never during a steady decode
            grown = torch.zeros(r if need_r <= r else max(need_r, 2 * r), c if need_c <= c else max(need_c, 2 * c),
                                dtype=torch.long)
            grown[:r, :c] = self.tables
            self.tables = grown
        rows, cols, ids = [], [], []  # one indexed write for the whole step
        for row, col, blocks in writes:
            rows.extend([row] * len(blocks))
            cols.extend(range(col, col + len(blocks)))
            ids.extend(blocks)
        if ids:
            self.tables.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(ids, dtype=torch.long))

    # --- one step ---
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> WorkerOutput | None:
        """The sampled tokens on the sampling rank; None on every other rank."""
        for handle in out.finished:
            self.states.pop(handle, None)
        if self.pooler.partial:
            self.pooler.forget([*out.finished, *out.preempted])
        if self.drafter is not None:  # the draft KV of sequences that went (or came back new) is no longer theirs
            self.drafter.forget([*out.finished, *out.preempted, *(new.handle for new in out.new)])
        lora_failures = self._load_loras(out.lora_loads)
        for h in out.encoder_free:
            self.encodings.pop(h, None)
        if out.encode:
            self._encode(out)
        batch = self.batch
        batch.update(out)
        self._write_tables()
        if not out.handles:
            return WorkerOutput([], [], {}, lora_failures=lora_failures) if self.parallel.is_sampler else None
        drafted = self._draft(out)
        rows = batch.plan(out, {**out.draft_token_ids, **drafted} if drafted else None)
        hidden = self._forward(rows)
        if hidden is None:
            return None
        tokens, lps, beams = [], [], {}
        if rows.sampling:  # every TP rank lends its vocabulary slice; TP rank 0 samples
            logits = self.model.compute_logits(hidden[torch.tensor(rows.sample_rows, device=self.device)])
            if logits is not None:
                states = [self._state(r.handle, r.seed) for r in rows.sampling]
                sampled = self.sampler(logits, rows.sampling, states, out.token_masks)
                tokens, lps, beams = sampled.token_ids, sampled.logprobs, sampled.beams
        prompt_lps = {}
        for pl in rows.prompt_logprobs:
            logits = self.model.compute_logits(hidden[pl.start:pl.start + len(pl.targets)])
            if logits is not None:
                prompt_lps[pl.handle] = rank_logprobs(logits.log_softmax(dim=-1), pl.targets, pl.k)
        if not self.parallel.is_sampler:
            return None
        pooled = self.pooler(hidden, rows.pooling) if rows.pooling else {}
        return WorkerOutput(tokens, lps, prompt_lps, beams, drafted, pooled, lora_failures)

    def _draft(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """The draft model's tokens for the drafts the core sent as placeholders (handle -> tokens)."""
        drafter = self.drafter
        if drafter is None:
            return {}
        if out.draft_catch_up:
            drafter.catch_up(self.batch, self.tables, out.draft_catch_up)
        wants = {h: len(d) for h, d in out.draft_token_ids.items() if d and d[0] == DRAFT_PLACEHOLDER}
        if not wants:
            return {}
        drafts = drafter.propose(self.batch, self.tables, wants)
        if self.parallel.tp_size > 1:  # every rank's forward takes TP rank 0's tokens, should a rank round apart
            flat = comm.broadcast(torch.tensor([t for h in wants for t in drafts[h]], device=self.device),
                                  self.parallel).tolist()
            at = 0
            for h, k in wants.items():
                drafts[h], at = flat[at:at + k], at + k
        return drafts

    def _encode(self, out: SchedulerOutput) -> None:
        """Run the vision encoder over the step's new images (one call for all of them); embeddings given in
        their place are taken as they are."""
        images = [item for item in out.encode if "image_embeds" not in item.data]
        encoded = dict(zip([item.hash for item in images],
                           self.model.encode_images([item.data for item in images], self.device) if images else []))
        dtype = self.loaded.dtype
        for item in out.encode:
            emb = encoded.get(item.hash)
            if emb is None:
                emb = torch.as_tensor(item.data["image_embeds"]).to(device=self.device, dtype=dtype)
            if emb.shape[0] != item.placeholder.length:
                raise ValueError(f"image {item.hash[:12]}: the encoder gave {emb.shape[0]} embeddings for "
                                 f"{item.placeholder.length} placeholder tokens")
            self.encodings[item.hash] = emb

    def _embeds(self, rows: StepRows, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The first layer's input when rows take image encodings: the token embeddings with those rows replaced."""
        x = self.model.embed(ids)
        for span in rows.embeds:
            x[span.row:span.row + span.count] = self.encodings[span.hash][span.first:span.first + span.count]
        return x, None

    def _state(self, handle: int, seed: int | None) -> RowState:
        state = self.states.get(handle)
        if state is None:
            state = self.states[handle] = RowState(seed)
        return state

    def _inputs(self, rows: StepRows, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Tensors of rows [r0, r1) of the batch (all of it, or one micro-batch)."""
        dev = self.device
        tables_t = lens_t = None
        d0, d1 = min(r0, rows.num_decode), min(r1, rows.num_decode)
        if d1 > d0:
            which = torch.tensor(rows.decode_table_rows[d0:d1], dtype=torch.long)
            tables_t = self.tables[which, :rows.decode_width].to(dev)
            lens_t = torch.tensor(rows.decode_context_lens[d0:d1], dtype=torch.long, device=dev)
        prefills = []
        for p in rows.prefills:
            start, stop = max(p.start, r0), min(p.start + p.length, r1)
            if stop > start:  # the part of this chunk in range; its context ends where the part ends
                prefills.append(PrefillSpan(start - r0, stop - start, p.context_len - (p.start + p.length - stop),
                                            self.tables[p.table_row, :p.num_blocks].to(dev), p.draft))
        ids, positions, slots = rows.input_ids, rows.positions, rows.slots
        if (r0, r1) != (0, rows.num_tokens):  # one micro-batch (a single stage copies nothing)
            ids, positions, slots = ids[r0:r1], positions[r0:r1], slots[r0:r1]
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), d1 - d0, tables_t, lens_t,
                                 prefills)
        if rows.mrope_positions is not None:  # [3, T]: (temporal, height, width) rows of an M-RoPE model
            positions = [p[r0:r1] for p in rows.mrope_positions]
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta)

    def _lora_batch(self, rows: StepRows, r0: int, r1: int) -> LoRABatch | None:
        if rows.lora_slots is None or self.lora is None:
            return None
        return LoRABatch.of(rows.lora_slots[r0:r1], self.lora.max_loras, self.lora.max_rank, self.loaded.dtype,
                            self.device)

    def _forward(self, rows: StepRows) -> torch.Tensor | None:
        """The whole batch through this rank's stage; the last stage's hidden states, None on other stages."""
        p = self.parallel
        graphs = self.graphs
        if graphs is not None and rows.num_decode == rows.num_tokens and not rows.embeds \
                and graphs.fits(rows.num_decode, rows.decode_width):
            which = torch.tensor(rows.decode_table_rows, dtype=torch.long)
            # an M-RoPE model's decode rows are text: their three position rows are equal, the first one serves
            positions = rows.positions if rows.mrope_positions is None else rows.mrope_positions[0]
            return graphs.run(rows.input_ids, positions, rows.slots, self.tables[which, :rows.decode_width],
                              rows.decode_context_lens)
        if p.pp_size == 1:
            ids, positions, meta = self._inputs(rows, 0, rows.num_tokens)
            first = self._embeds(rows, ids) if rows.embeds else None  # a split model takes no images (check_parallel)
            return self.model(ids, positions, meta, first, self._lora_batch(rows, 0, rows.num_tokens))
        outs, sends = [], []
        hidden = self.loaded.shape.hidden_size
        for r0, r1 in micro_batches(rows.num_tokens, p.pp_size):
            ids, positions, meta = self._inputs(rows, r0, r1)
            intermediate = None
            if not p.is_first_stage:
                buf = comm.recv((2, r1 - r0, hidden), self.loaded.dtype, self.device, p.stage_peer(-1))
                intermediate = (buf[0], buf[1])
            out = self.model(ids, positions, meta, intermediate, self._lora_batch(rows, r0, r1))
            if p.is_last_stage:
                outs.append(out)
            else:  # (x, residual) to the same TP rank of the next stage; on to the next micro-batch meanwhile
                x = torch.stack(out)
                sends.append((comm.send(x, p.stage_peer(1)), x))
        for work, _ in sends:
            work.wait()
        return torch.cat(outs) if outs else None

    def _load_loras(self, loads: list[LoRALoad]) -> dict[int, str]:
        """Read each adapter into its slot; one whose files can no longer be read (removed or rewritten since it was
        accepted) leaves its slot empty and is reported (slot -> why): the core ends the requests that need it, so the
        engine, and every other request, goes on."""
        failures: dict[int, str] = {}
        for load in loads:
            try:
                self.load_lora(load)
            except (EmberError, OSError, KeyError) as e:  # the reader names the file (KeyError: rewritten between
                # its check and this read)
                for stack in self.model.lora_stacks():
                    stack.clear(load.slot)
                failures[load.slot] = str(e)
        return failures

    def load_lora(self, load: LoRALoad) -> None:
        """Read an adapter into a slot: this rank's slice of each of its modules (a column-parallel projection's
        B rows, a row-parallel one's A columns, as ``weight_slice`` cuts the base weight), zeros elsewhere."""
        # read in float32: the scaling is folded into B before the one rounding to the model's dtype
        adapter = read_adapter(load.path, load.path, self.loaded.shape, self.lora.max_rank)
        for stack in self.model.lora_stacks():
            stack.clear(load.slot)
        for (layer, proj), w in adapter.weights.items():
            target = self.model.lora_target(layer, proj)
            if target is None:
                continue
            cut = self.model.weight_slice(module_name(layer, proj) + ".weight")
            a = cut.apply(w.a) if cut.dim == 1 else w.a
            b = cut.apply(w.b) if cut.dim == 0 else w.b
            target[0].set(load.slot, target[1], a.to(self.device), b.to(self.device), w.scaling)
