"""Structured output (``SamplingParams(structured_outputs=...)``), enforced by llguidance token masks.

On the default model in float32: 50 JSON schemas drawn by hypothesis, every reply parses and validates with
``jsonschema``; regex replies fullmatch, choices are exact, Lark and GBNF grammars hold; free requests batched
with guided ones get the greedy tokens they get alone; a reply cut by max_tokens ends "length"; schemas, regexes
and grammars that cannot compile are refused before anything is queued, with llguidance's message.
"""

from __future__ import annotations

import json
import pickle
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember import LLM, SamplingParams
from ember.errors import BadRequestError
from ember.layers.sampler import apply_token_masks
from ember.sampling_params import StructuredOutputsParams as SO
from ember.worker.token_masks import TokenMasks


@pytest.fixture(scope="module")
def llm():
    # a 512-token step budget: the prompts are short, and start-up's measuring prefill is of the budget's size
    engine = LLM(dtype="float32", max_num_seqs=64, max_model_len=2048, max_num_batched_tokens=512)
    yield engine
    engine.shutdown()


def _chat(llm, text: str) -> list[int]:
    return llm.client.chat_prompt([{"role": "user", "content": text}])


def _greedy(max_tokens: int, **so) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=SO(**so) if so else None)


# ----- the parameters and the masks, without a model -----

def test_params_validation():
    assert SO(regex="a+").kind == "regex"
    assert SamplingParams(structured_outputs={"choice": ["x", "y"]}).structured_outputs == SO(choice=["x", "y"])
    with pytest.raises(BadRequestError, match="exactly one of json, regex, choice, grammar, json_object"):
        SO(regex="a", choice=["a"])
    with pytest.raises(BadRequestError, match="exactly one"):
        SO()
    with pytest.raises(BadRequestError, match=r"structured_outputs.choice=\[\] is out of range"):
        SO(choice=[])
    with pytest.raises(BadRequestError, match="structured_outputs.regex=3"):
        SO(regex=3)
    with pytest.raises(BadRequestError, match="structured_outputs.json=5"):
        SO(json=5)
    with pytest.raises(BadRequestError, match="disable_any_whitespace='yes'"):
        SO(json_object=True, disable_any_whitespace="yes")
    with pytest.raises(BadRequestError, match="unexpected keyword argument 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(BadRequestError, match="structured_outputs=.*None with beam_width > 1"):
        SamplingParams(beam_width=2, temperature=0, structured_outputs=SO(regex="a"))
    with pytest.raises(BadRequestError, match="structured_outputs='a'"):
        SamplingParams(structured_outputs="a")


def test_apply_token_masks_and_pickle():
    V = 70  # three 32-token words, the last one partly past the vocabulary
    allowed = {0: [0, 31, 32, 69], 2: [5]}
    bits = torch.zeros(2, 3, dtype=torch.int32)
    for j, ids in enumerate(allowed.values()):
        for t in ids:
            bit = 1 << (t % 32)
            bits[j, t // 32] |= bit - (1 << 32 if bit >= 1 << 31 else 0)
    masks = pickle.loads(pickle.dumps(TokenMasks(list(allowed), bits)))
    logits = torch.randn(3, V)
    out = apply_token_masks(logits, masks.rows, masks.get())
    for row in range(3):
        keep = allowed.get(row, range(V))
        want = torch.full((V,), float("-inf"))
        want[list(keep)] = logits[row, list(keep)]
        assert torch.equal(out[row], want)
    wide = apply_token_masks(torch.zeros(1, 100), [0], bits[:1])  # logits wider than the mask: the rest banned
    assert wide[0, 70:].eq(float("-inf")).all() and wide[0, 69] == 0


# ----- on the model -----

def _schemas() -> st.SearchStrategy[dict]:
    """Objects whose every document is bounded (strings, arrays and integers have limits), so a reply must end."""
    names = st.from_regex(r"[a-z]{1,8}", fullmatch=True)
    leaf = st.one_of(
        st.just({"type": "boolean"}),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-100, 100), st.integers(0, 1000)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 16)),
        st.lists(names, min_size=1, max_size=4, unique=True).map(lambda e: {"enum": e}),
    )  # no "number": JSON cannot bound its digits, and the model may write them until max_tokens

    def obj(children):
        return st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))

    def arr(children):
        return st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo,
                                                  "maxItems": lo + extra}, children, st.integers(0, 2),
                         st.integers(0, 2))

    return obj(st.recursive(leaf, lambda c: st.one_of(obj(c), arr(c)), max_leaves=5))


def test_fifty_json_schemas_validate(llm):
    drawn: list[dict] = []

    @settings(max_examples=50, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(_schemas())
    def collect(schema):
        drawn.append(schema)

    collect()
    assert len(drawn) == 50
    prompts = [_chat(llm, f"Reply with JSON that follows this schema: {json.dumps(s)}") for s in drawn]
    params = [_greedy(512, json=s, disable_any_whitespace=i % 2 == 1) for i, s in enumerate(drawn)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(drawn, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert llm.client.stats()["guided_rows"] > 0


SENTENCE = r"(Paris|London) is (big|small)\."


def test_regex_choice_grammars_and_json_object(llm):
    prompt = _chat(llm, "What is the capital of France? Also give a phone number.")
    cases = [
        (_greedy(24, regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (_greedy(24, regex=SENTENCE), lambda t: re.fullmatch(SENTENCE, t)),
        (_greedy(24, choice=["Paris", "Lyon", "Rome, Italy"]), lambda t: t in ("Paris", "Lyon", "Rome, Italy")),
        (_greedy(24, grammar='start: answer "."\nanswer: "yes" | "no"'), lambda t: t in ("yes.", "no.")),
        (_greedy(24, grammar='root ::= "The answer is " [0-9] [0-9]?'),
         lambda t: re.fullmatch(r"The answer is \d\d?", t)),
        (_greedy(96, json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    # any object is unbounded: asked about Paris the model nests objects on and on, so this one is shown an answer
    prompts = [prompt] * (len(cases) - 1) + [_chat(llm, 'Reply with this JSON object: {"city": "Paris"}')]
    outs = llm.generate(prompts, [p for p, _ in cases], use_tqdm=False)
    for (params, check), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (params.structured_outputs, c.text)


def test_free_requests_keep_their_greedy_tokens_beside_guided_ones(llm):
    free = [_chat(llm, "Name three colours."), _chat(llm, "Count to five.")]
    alone = [o.outputs[0].token_ids for o in llm.generate(free, _greedy(24), use_tqdm=False)]
    guided = _chat(llm, "Give me a JSON object.")
    mixed = llm.generate([free[0], guided, free[1], guided],
                         [_greedy(24), _greedy(24, json_object=True), _greedy(24), _greedy(24, regex="[a-z]+")],
                         use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_samples_and_sampling_each_follow_the_grammar(llm):
    prompt = _chat(llm, "Pick a colour.")
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16,
                            structured_outputs=SO(choice=["red", "green", "blue", "dark violet"]))
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert all(c.text in ("red", "green", "blue", "dark violet") and c.finish_reason == "stop" for c in out.outputs)


def test_cut_by_max_tokens_ends_with_length(llm):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    out = llm.generate(_chat(llm, "Tell me a long story as JSON."), _greedy(8, json=schema), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 8
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


@pytest.mark.parametrize("so, message", [
    (SO(regex="a("), r"(?s)structured_outputs.regex cannot be compiled: .*unclosed group"),
    (SO(json="{not json"), r"structured_outputs.json is not valid JSON"),
    (SO(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     r"(?s)structured_outputs.json cannot be compiled: .*nonsense"),
    (SO(grammar="start: undefined_rule"), r"(?s)structured_outputs.grammar cannot be compiled: .*undefined_rule"),
    (SO(json={"type": "integer", "maximum": -2 ** 63 - 1}),  # found by the server fuzz test
     r"structured_outputs.json cannot be used as a schema: .*not JSON serializable"),
])
def test_bad_constraints_fail_before_work_and_the_engine_goes_on(llm, so, message):
    before = llm.client.stats()["guided_rows"]
    with pytest.raises(BadRequestError, match=message):
        llm.generate(["hi", "there"], [_greedy(4), SamplingParams(temperature=0, max_tokens=4, structured_outputs=so)],
                     use_tqdm=False)
    assert llm.client.stats()["guided_rows"] == before
    assert llm.generate("hi", _greedy(4, regex="[a-z]{4}"), use_tqdm=False)[0].outputs[0].finish_reason == "stop"


# ----- with speculative decoding -----

@pytest.fixture(scope="module")
def spec_llm():
    engine = LLM(dtype="float32", max_num_seqs=64, max_model_len=2048, max_num_batched_tokens=512,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1})
    yield engine
    engine.shutdown()


def test_drafts_follow_the_grammar_and_change_no_token(llm, spec_llm, monkeypatch):
    """n-gram drafts for guided requests: cut to what the grammar takes (spied on: some are cut), verified with a
    mask after each drafted token; every reply is the one decoding without speculation gives, token for token,
    greedy and seeded, and drafts are kept and rejected."""
    import ember.core.speculator as speculator
    from ember.core.guided import Guides

    monkeypatch.setattr(speculator, "verify_extra", lambda k, costs=None: 0.0)  # every draft as long as it can be
    cuts, valid_draft = [], Guides.valid_draft

    def spy(self, seq, draft):
        kept = valid_draft(self, seq, draft)
        cuts.append(len(kept) < len(draft))
        return kept

    monkeypatch.setattr(Guides, "valid_draft", spy)
    record = {"name": "Ada Lovelace", "born": 1815, "languages": ["English", "French", "Italian"],
              "known_for": "the first published computer program"}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                               "languages": {"type": "array", "items": {"type": "string"}},
                                               "known_for": {"type": "string"}},
              "required": list(record), "additionalProperties": False}
    copy = _chat(llm, f"Reply with exactly this JSON object: {json.dumps(record)}")
    extract = _chat(llm, "Ada Lovelace, born in 1815, spoke English, French and Italian, and is known for the first "
                         "published computer program. Give her record as JSON.")
    phone = _chat(llm, "Our office number is 555-0199, call 555-0199 now. What is the number?")
    prompts = [copy, copy, extract, phone, phone]
    params = [_greedy(96, json=schema), _greedy(96, json=schema, disable_any_whitespace=True),
              _greedy(96, json=schema), _greedy(16, regex=r"[0-9]{3}-[0-9]{4}"),
              SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=16,
                             structured_outputs=SO(regex=r"(call )?[0-9]{3}-[0-9]{4}( now)?"))]
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    before = spec_llm.stats()
    outs = spec_llm.generate(prompts, params, use_tqdm=False)
    after = spec_llm.stats()
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    jsonschema.validate(json.loads(outs[0].outputs[0].text), schema)
    assert all(re.fullmatch(r"(call )?[0-9]{3}-[0-9]{4}( now)?", c.text) for c in outs[4].outputs)
    drafted, kept = (after[k] - before[k] for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    assert 0 < kept < drafted and any(cuts) and not all(cuts)


def test_a_drafts_masks_are_the_masks_one_token_steps_give(llm):
    """``Guides.masks`` for a row verifying a draft against a matcher taking the same tokens one step at a time,
    as decoding without drafts does (a stopped matcher's mask is llguidance's, one EOS, whatever EOS ids the request
    has): the mask after each drafted token, EOS drafted where the grammar may go on or end or after its end
    (llguidance leaves the row after such an EOS empty). Then ``advance`` feeds the matcher the kept tokens: all,
    or those before the first the sampler disagreed with and the sampler's own."""
    from types import SimpleNamespace

    import llguidance.torch as llg

    from ember.core.guided import Guides
    from ember.frontend.structured_output import Grammars

    tok, eos = llm.client.tokenizer, llm.client.tokenizer.eos_token_id
    grammars = Grammars(tok, (eos,))
    grammar = grammars.compile(SO(regex=r"[0-9]{3}-[0-9]{3}( now)?"))
    number, full, two = (tok.encode(t, add_special_tokens=False) for t in ("199-555", "199-555 now", "2"))
    request = SimpleNamespace(record=SimpleNamespace(grammar=grammar),
                              params=SimpleNamespace(eos_token_ids=(eos, eos + 1)))  # a second EOS id
    guides = Guides(grammars)
    cut = SimpleNamespace(seq_id=0, request=request, draft_token_ids=[])
    assert guides.valid_draft(cut, number + [eos, eos, 7]) == number + [eos]  # nothing after the grammar's end
    assert guides.valid_draft(cut, number[:2] + [eos]) == number[:2]  # EOS only where it may end
    # an id past the tokenizer's vocabulary (logits can be wider) ends the draft, and the matcher goes on
    assert guides.valid_draft(cut, number[:2] + [grammars.vocab_size] + number[2:]) == number[:2]
    assert not guides.matchers[cut.seq_id].is_error() and guides.valid_draft(cut, number) == number

    def one_token_steps(tokens: list[int]) -> list[torch.Tensor]:
        one, out = grammars.matcher(grammar), []
        for t in tokens + [None]:
            out.append(torch.zeros(1, (grammars.vocab_size + 31) // 32, dtype=torch.int32))
            llg.fill_next_token_bitmask(one, out[-1], 0)
            if t is not None and not one.is_stopped():  # as Guides.advance: a stopped grammar takes nothing
                assert one.consume_token(t)
        return out

    for draft in (number, number + [eos], full + [eos], number[:2]):
        seq = SimpleNamespace(seq_id=1 + len(draft), request=request, draft_token_ids=draft)
        masks = guides.masks([seq] * (len(draft) + 1))
        got = masks.get()
        for j, want in enumerate(one_token_steps(draft)):
            assert torch.equal(got[j], want[0]), (draft, j)
        after = number[len(draft)] if len(draft) < len(number) else eos
        guides.advance([seq] * (len(draft) + 1), draft + [after], masks)  # every drafted token kept, then one more
        m = guides.matchers[seq.seq_id]
        assert not m.is_error() and m.is_stopped() == (len(draft) >= len(number))
    # the sampler disagrees at drafted position 4 ("2", not "5"): the matcher takes 4 drafted tokens and the "2"
    seq = SimpleNamespace(seq_id=99, request=request, draft_token_ids=number)
    masks = guides.masks([seq] * (len(number) + 1))
    guides.advance([seq] * (len(number) + 1), number[:4] + two + [7] * (len(number) - 4), masks)
    seq.draft_token_ids = []
    after = guides.masks([seq]).get()[0]
    assert torch.equal(after, one_token_steps(number[:4] + two)[-1][0])
    guides.shutdown()
