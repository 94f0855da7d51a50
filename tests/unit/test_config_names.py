"""Native configuration names are ember's (vLLM's where vLLM has one); other engines' names live in ember/compat.
Names that were native before they moved there are still taken, with a DeprecationWarning naming the new one."""

import pytest

from ember.config import EngineConfig
from ember.errors import ConfigError


def test_streaming_llm_fields_under_tensorrt_llm_names():
    with pytest.warns(DeprecationWarning) as record:
        config = EngineConfig(max_attention_window_size=64, sink_token_length=4)
    assert [str(w.message) for w in record] == ["max_attention_window_size is TensorRT-LLM's name; ember's is "
                                                "attention_window",
                                                "sink_token_length is TensorRT-LLM's name; ember's is sink_tokens"]
    assert (config.attention_window, config.sink_tokens) == (64, 4)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="attention_window=4 is out of range"):
        EngineConfig(max_attention_window_size=4, sink_token_length=4)


def test_native_names_warn_nothing(recwarn):
    config = EngineConfig(attention_window=64, sink_tokens=4)
    assert (config.attention_window, config.sink_tokens) == (64, 4)
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
