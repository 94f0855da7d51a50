"""The front end's output processing without an engine: the core's records in (``EngineOutput``), text, stop
strings, finish reasons and ``RequestOutput`` deltas out, with the default model's tokenizer."""

from __future__ import annotations

import pytest

from ember.frontend.output_processor import OutputProcessor, RequestState
from ember.protocol import EngineOutput, FinishReason, SampleOutput, TokenLogprobs
from ember.sampling_params import SamplingParams
from ember.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


def _start(proc: OutputProcessor, tok: Tokenizer, rid: str = "r", **params) -> list:
    got: list = []
    prompt = tok.encode("The answer:", add_special_tokens=False)
    proc.register([RequestState(rid, "The answer:", prompt, SamplingParams(**params), got.append)])
    return got


def _two_samples(proc: OutputProcessor, tok: Tokenizer, max_tokens: int) -> list:
    """A request of n = 2 stopping at " maybe", as ``parallel_sampling.fan_out`` hands it over: core requests r#0
    and r#1 are its samples 0 and 1."""
    got: list = []
    prompt = tok.encode("The answer:", add_special_tokens=False)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=max_tokens, stop=[" maybe"])
    proc.register([RequestState("r", "The answer:", prompt, params, got.append, ["r#0", "r#1"])])
    return got


def _step(rid: str, *samples: SampleOutput) -> EngineOutput:
    return EngineOutput(rid, list(samples), num_cached_tokens=0)


def test_a_stop_string_cuts_the_text_and_is_reported_back_to_the_core(tok):
    """Several tokens in one step (a beam's answer; speculative decoding's accepted tokens): the text and the
    tokens end at the stop string."""
    proc = OutputProcessor(tok)
    got = _start(proc, tok, stop=["world"], max_tokens=20)
    ids = tok.encode(" Hello world and more", add_special_tokens=False)
    stops = proc.process([_step("r", SampleOutput(0, ids))])
    assert stops == [("r", 0)]  # the core finishes the sample before its next step
    (out,) = got
    assert out.finished and out.outputs[0].text == " Hello "
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "world"
    assert tok.decode(out.outputs[0].token_ids) == " Hello world"  # tokens after the stop string are dropped
    assert "r" not in proc.states  # the id is free again


def test_prediction_tokens_are_counted_against_each_finished_completion(tok):
    """OpenAI's accepted / rejected_prediction_tokens: the prediction's tokens that appear in the completion (as
    multisets) and the rest, per sample, summed; set once the request ends. Drafts kept do not count (they may be
    lookup or draft-model tokens, or past the stop string), tokens after a stop string are not in the completion."""
    proc = OutputProcessor(tok)
    got: list = []
    prompt = tok.encode("The answer:", add_special_tokens=False)
    prediction = tok.encode(" Hello world and more words", add_special_tokens=False)
    params = SamplingParams(n=2, max_tokens=20, stop=["world"])
    proc.register([RequestState("r", "The answer:", prompt, params, got.append, ["r#0", "r#1"], False, prediction)])
    hello, rest, other = (tok.encode(t, add_special_tokens=False) for t in (" Hello world", " and more",
                                                                             " Goodbye more more more"))
    proc.process([_step("r#0", SampleOutput(0, hello + rest, num_draft_tokens=8, num_accepted_draft_tokens=8))])
    assert got[-1].metrics.accepted_prediction_tokens is None  # not finished yet
    proc.process([_step("r#1", SampleOutput(0, other, finish_reason=FinishReason.LENGTH))])
    m = got[-1].metrics
    assert got[-1].finished and m.num_accepted_draft_tokens == 8
    assert m.accepted_prediction_tokens == len(hello) + 1  # sample 0 up to " world"; sample 1 one " more"
    assert m.rejected_prediction_tokens == 2 * len(prediction) - m.accepted_prediction_tokens
    assert m.accepted_prediction_tokens <= sum(len(c.token_ids) for c in got[-2].outputs + got[-1].outputs)


def test_a_request_of_n_samples_ends_when_the_last_one_does(tok):
    """n = 2 reaches the core as two requests (``parallel_sampling.fan_out``); their outputs come back as the
    request's samples 0 and 1, a stop string found in one is reported under its core request's id."""
    proc = OutputProcessor(tok)
    got = _two_samples(proc, tok, max_tokens=2)
    a, b = tok.encode(" yes", add_special_tokens=False), tok.encode(" no", add_special_tokens=False)
    stops = proc.process([_step("r#0", SampleOutput(0, a + a, finish_reason=FinishReason.LENGTH)),
                          _step("r#1", SampleOutput(0, b))])
    assert not stops and not got[-1].finished and [c.index for c in got[-1].outputs] == [1]
    assert [c.index for c in got[-2].outputs] == [0]
    stops = proc.process([_step("r#1", SampleOutput(0, tok.encode(" maybe", add_special_tokens=False)))])
    assert stops == [("r#1", 0)]
    assert got[-1].finished and got[-1].outputs[0].index == 1 and got[-1].outputs[0].finish_reason == "stop"
    assert got[-1].metrics.num_generated_tokens == len(a + a) + len(b) + len(tok.encode(" maybe",
                                                                                       add_special_tokens=False))
    assert not proc.states and not proc.routes  # the id and its core ids are free again


def test_a_core_id_in_use_is_refused(tok):
    proc = OutputProcessor(tok)
    prompt = [1, 2]
    proc.register([RequestState("r", None, prompt, SamplingParams(n=2), print, ["r#0", "r#1"])])
    with pytest.raises(Exception, match="already in use"):
        proc.register([RequestState("r#1", None, prompt, SamplingParams(), print)])


def test_logprobs_are_decoded_and_summed_and_an_abort_ends_the_request(tok):
    proc = OutputProcessor(tok)
    got = _start(proc, tok, logprobs=1, max_tokens=10)
    t = tok.encode(" yes", add_special_tokens=False)[0]
    lp = TokenLogprobs(-0.5, 1, [t], [-0.5])
    proc.process([_step("r", SampleOutput(0, [t, t], new_logprobs=[lp, lp]))])
    first = got[-1].outputs[0]
    assert first.cumulative_logprob == pytest.approx(-1.0)
    assert first.logprobs[0][t].decoded_token == tok.decode([t], skip_special_tokens=False)
    proc.process([_step("r", SampleOutput(0, [], finish_reason=FinishReason.ABORT))])
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "abort"


def test_outputs_of_unknown_requests_are_ignored_and_fail_all_reaches_every_sink(tok):
    proc = OutputProcessor(tok)
    got = _start(proc, tok)
    assert proc.process([_step("someone-else", SampleOutput(0, [5]))]) == []
    error = RuntimeError("engine stopped")
    proc.fail_all(error)
    assert got == [error] and not proc.states


def test_a_step_after_a_stop_string_adds_nothing_to_the_stopped_sample(tok):
    """A core in its own process hears of a stop string one step late: it sends the stopped sample one more token
    (finish_reason None) before it finishes it. That token is not the answer, and the sample stays stopped: it
    used to be appended and to clear the finish reason, so a request of n > 1 never finished (found by many
    callers on the core process)."""
    proc = OutputProcessor(tok)
    got = _two_samples(proc, tok, max_tokens=8)
    maybe, yes = tok.encode(" maybe", add_special_tokens=False), tok.encode(" yes", add_special_tokens=False)
    assert proc.process([_step("r#0", SampleOutput(0, maybe))]) == [("r#0", 0)]
    assert proc.process([_step("r#0", SampleOutput(0, yes)), _step("r#1", SampleOutput(0, yes))]) == []
    assert all(c.index == 1 for o in got[1:] for c in o.outputs)  # nothing more for sample 0
    proc.process([_step("r#1", SampleOutput(0, yes, finish_reason=FinishReason.LENGTH))])
    assert got[-1].finished and "r" not in proc.states
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].token_ids == maybe
