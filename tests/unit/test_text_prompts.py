"""The text prompts of ``ember bench latency --prompts text``: three kinds, seeded, and the predictions the
ember-prediction backend sends (copy and code prompts: the answer they expect; chat: none)."""

from __future__ import annotations

from conftest import default_gguf

from ember.benchmarks.text_prompts import KINDS, text_prompts
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
