"""``POST /v1/embeddings`` over HTTP: an encoder served by ``ember serve`` answers OpenAI's body (float and base64,
against sentence-transformers), refuses bad fields with a 400 that names them, and refuses generation; a decoder's
one server answers completions and embeddings side by side."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import torch
from embedding_models import cosines, save_st_bert, texts
from server_utils import post, running_server

INPUTS = ["hello world", "the quick brown fox jumps over the lazy dog", *texts(4, 5, 50, seed=2)]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory) -> str:
    return save_st_bert(str(tmp_path_factory.mktemp("bert-server")), "mean", True)


@pytest.fixture(scope="module")
def server(bert_folder):
    with running_server(bert_folder, "--max-num-seqs", "8", "--dtype", "float32",
                        "--served-model-name", "minibert") as srv:
        yield srv


def _post(server, path: str, payload: dict | bytes) -> tuple[int, dict]:
    answer = asyncio.run(post(server.url, path, payload))
    return answer.status, json.loads(answer.body)


def test_embeddings_match_sentence_transformers(server, bert_folder):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(bert_folder, device="cpu")
    ref = model.encode(INPUTS, convert_to_tensor=True).float()
    status, body = _post(server, "/v1/embeddings", {"input": INPUTS, "model": "minibert"})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "minibert"
    assert [d["index"] for d in body["data"]] == list(range(len(INPUTS)))
    assert all(d["object"] == "embedding" for d in body["data"])
    got = torch.tensor([d["embedding"] for d in body["data"]])
    assert min(cosines(got, ref)) >= 0.9999
    tokens = sum(len(model.tokenizer(t)["input_ids"]) for t in INPUTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    status, b64 = _post(server, "/v1/embeddings", {"input": INPUTS, "encoding_format": "base64"})
    assert status == 200, b64
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() for d in b64["data"]]
    assert decoded == [d["embedding"] for d in body["data"]]  # the same float32 values, byte for byte

    status, cut = _post(server, "/v1/embeddings", {"input": INPUTS[0], "dimensions": 16})
    vec = torch.tensor(cut["data"][0]["embedding"])
    assert status == 200 and vec.shape == (16,)
    torch.testing.assert_close(vec, torch.nn.functional.normalize(got[0, :16], dim=0), atol=1e-5, rtol=1e-5)

    ids = model.tokenizer(INPUTS[1])["input_ids"]
    for given in (ids, [ids, ids]):  # one input as token ids, and a list of them
        status, by_ids = _post(server, "/v1/embeddings", {"input": given})
        assert status == 200, by_ids
        assert min(cosines(torch.tensor([d["embedding"] for d in by_ids["data"]]), ref[1:2])) >= 0.9999


@pytest.mark.parametrize("payload, param, words", [
    ({"input": []}, "input", "empty"),
    ({"input": ""}, "input", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": [5, 99999]}, "input", "99999 is out of range"),
    ({"input": " ".join(["hello"] * 150)}, "input", "max_model_len (100)"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "[1, 64]"),
    ({"input": "hi", "dimensions": 65}, "dimensions", "[1, 64]"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ({"input": "hi", "pooling_type": "max"}, "pooling_type", ""),
    ({"model": "minibert"}, "input", "required"),
])
def test_bad_embedding_requests_are_refused_by_field(server, payload, param, words):
    status, body = _post(server, "/v1/embeddings", payload)
    assert status in (400, 404), body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_encoder_refuses_generation(server):
    status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2})
    assert status == 400 and "encoder" in body["error"]["message"], body
    status, body = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 400 and "embeddings only" in body["error"]["message"], body


def test_decoder_serves_completions_and_embeddings(llama_dir):
    """One ``ember serve`` of a decoder: generation and last-token embeddings, no second server."""
    with running_server(llama_dir, "--max-num-seqs", "16", "--max-model-len", "512", "--dtype", "float32") as srv:
        status, done = _post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert status == 200 and done["usage"]["completion_tokens"] == 4, done
        status, body = _post(srv, "/v1/embeddings", {"input": ["Hello", "Hello world"]})
        assert status == 200, body
        vecs = torch.tensor([d["embedding"] for d in body["data"]])
        assert vecs.shape == (2, 64) and torch.allclose(vecs.norm(dim=-1), torch.ones(2), atol=1e-5)
