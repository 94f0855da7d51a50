"""DashInfer's ``MultiMediaInfo``: image embeddings for a request's placeholder tokens (``mm_info`` in its
generation config). Each key is a placeholder token id (as a string); each run of that id in the input ids takes
the next tensor of its list, whose rows must equal the run's length, as DashInfer's engine checks. On ember the
runs become the model's image token and the tensors ``multi_modal_data['image_embeds']`` (no vision encoder runs:
the embeddings are the encoder's output, computed by the caller)."""

from __future__ import annotations

from typing import Any

from ember.compat.dashinfer.allspark.status import AsStatus


class MultiMediaInfo:
    def __init__(self) -> None:
        self.contents: dict[str, list[Any]] = {}
        self.multimedia_type = 0  # DashInfer's: 0, embeddings (the only kind its engine reads)

    def add_multimedia_content(self, identifier: str, content: list[Any]) -> AsStatus:
        """Tensors (torch, numpy or DLPack capsules) for the placeholder token ``identifier``, in order."""
        if not str(identifier).isdigit():
            raise ValueError(f"identifier={identifier!r} is not supported: pass the placeholder token id as a string")
        if not isinstance(content, (list, tuple)) or not content:
            raise ValueError("content must be a non-empty list of tensors (torch, numpy or DLPack capsules)")
        self.contents.setdefault(str(identifier), []).extend(_tensor(c) for c in content)
        return AsStatus.ALLSPARK_SUCCESS

    def set_multimedia_type(self, multimedia_type: int) -> AsStatus:
        if multimedia_type != 0:
            raise ValueError(f"multimedia_type={multimedia_type!r} is not supported: use 0 (embeddings)")
        self.multimedia_type = multimedia_type
        return AsStatus.ALLSPARK_SUCCESS

    def prompt(self, ids: list[int], image_token_id: int | None) -> dict[str, Any]:
        """The native prompt: each placeholder run rewritten to the model's image token, with its tensor."""
        if image_token_id is None:
            raise ValueError("mm_info is not supported by this model: it takes text only (serve a vision-language "
                             "model, e.g. LLaVA)")
        out, embeds, taken = list(ids), [], {k: 0 for k in self.contents}
        i = 0
        while i < len(out):
            key = str(out[i])
            if key not in self.contents:
                i += 1
                continue
            j = i
            while j < len(out) and str(out[j]) == key:
                out[j] = image_token_id
                j += 1
            if taken[key] == len(self.contents[key]):
                raise ValueError(f"mm_info: input_ids hold more runs of placeholder {key} than its "
                                 f"{len(self.contents[key])} tensors")
            tensor = self.contents[key][taken[key]]
            if j - i != tensor.shape[0]:  # DashInfer's rule: a run is exactly its embedding's rows
                raise ValueError(f"mm_info: the run of placeholder {key} at input_ids[{i}] is {j - i} tokens long; "
                                 f"its tensor has {tensor.shape[0]} rows: they must be equal")
            if i and str(ids[i - 1]) in self.contents and str(ids[i - 1]) != key:
                raise ValueError(f"mm_info: runs of placeholders {ids[i - 1]} and {key} touch at input_ids[{i}]: "
                                 "separate them by another token")
            embeds.append(tensor)
            taken[key] += 1
            i = j
        unused = {k: len(v) - taken[k] for k, v in self.contents.items() if len(v) > taken[k]}
        if unused:
            raise ValueError(f"mm_info: tensors left without a placeholder run in input_ids: {unused}")
        return {"prompt_token_ids": out, "multi_modal_data": {"image_embeds": embeds}}


def _tensor(value: Any) -> Any:
    if type(value).__name__ == "PyCapsule":  # DLPack, as DashInfer's example hands them over
        import torch.utils.dlpack

        return torch.utils.dlpack.from_dlpack(value)
    return value
