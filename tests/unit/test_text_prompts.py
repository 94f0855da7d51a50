"""The text prompts of ``ember bench latency --prompts text``: three kinds, seeded, and the predictions the
ember-prediction backend sends (copy and code prompts: the answer they expect; chat: none); the JSON records of
``--prompts json``."""

from __future__ import annotations

import json

import jsonschema
from conftest import default_gguf

from ember.benchmarks.runner import GUIDED_SCHEMA
from ember.benchmarks.text_prompts import KINDS, record_prompts, text_prompts
from ember.tokenizer import Tokenizer


def test_copy_and_code_prompts_carry_what_they_ask_back():
    path = default_gguf()
    tok = Tokenizer.load(path, gguf_file=path)
    prompts = text_prompts(tok, 2, seed=3)
    assert [kind for kind, _, _ in prompts] == list(KINDS) * 2
    assert prompts == text_prompts(tok, 2, seed=3)  # seeded: every backend and repeat gets the same tokens
    for kind, ids, predicted in prompts:
        if kind == "chat":
            assert predicted is None
            continue
        expected = tok.decode(predicted)
        assert len(predicted) > 100 and expected in tok.decode(ids)  # the passage / the file, as the prompt gives it
        if kind == "code":
            assert expected.startswith("```python\n") and expected.endswith("\n```")


def test_record_prompts_hold_the_values_their_record_copies():
    path = default_gguf()
    tok = Tokenizer.load(path, gguf_file=path)
    prompts = record_prompts(tok, 3, seed=1)
    assert prompts == record_prompts(tok, 3, seed=1) and len({tuple(ids) for _, ids, _ in prompts}) == 3
    for kind, ids, predicted in prompts:
        record, text = json.loads(tok.decode(predicted)), tok.decode(ids)
        jsonschema.validate(record, GUIDED_SCHEMA)  # the answer the guided backends' schema asks for
        assert kind == "record" and f"Title: {record['title']}\nFirst published: {record['year']}" in text
        assert f"Shelved under: {', '.join(record['tags'])}" in text
