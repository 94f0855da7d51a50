"""ember's tokenizer fast path (the `tokenizers` library and ember.chat_template, no transformers) against
transformers' own tokenizer on the same files: token ids, decoded text, special ids, and chat templates of several
families rendered with the features templates use (system prompts, tools, loop controls, namespace, raise_exception,
the generation tag)."""

from __future__ import annotations

import pytest
from conftest import default_gguf

from ember import chat_template
from ember.tokenizer import Tokenizer

TEXTS = ["The capital of France is", " leading space", "<|im_start|>user\nhi<|im_end|>", "émoji 🎉 and 中文", "",
         "a\n\n  b\t", "def f(x):\n    return x ** 2  # square"]

# templates in the styles of the model families ember serves (SmolLM2/Qwen ChatML with tools, Llama 3, Mistral)
CHATML_TOOLS = """{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}{{- "\\n\\n# Tools\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}{{- "\\n</tools><|im_end|>\\n" }}{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}{%- if message.role == "system" and loop.first %}{% continue %}{% endif %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
LLAMA3 = """{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}{%- set ns = namespace(system='') %}{%- for m in messages %}{%- if m['role'] == 'system' %}{%- set ns.system = m['content'] | trim %}{%- endif %}{%- endfor %}{{- "<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: " + date_string + "\\n\\n" + ns.system + "<|eot_id|>" }}{%- for m in messages if m['role'] != 'system' %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
MISTRAL = """{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}"""
DATA = """{% for m in messages %}{{ m.role }}:{{ m.content | tojson }}{% if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}|{{ m.thinking if m.thinking is defined else '-' }}
{% endfor %}{{ dict(a=1) | tojson }}{{ extra_flag }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi é 中"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
]


@pytest.fixture(scope="module")
def tokenizers():
    path = default_gguf()
    ours = Tokenizer.load(path, gguf_file=path)
    assert ours._fast is not None, "the converted GGUF tokenizer takes the fast path"
    return ours, ours.hf


def test_fast_tokenizer_matches_transformers(tokenizers):
    ours, hf = tokenizers
    assert (ours.eos_token_id, ours.bos_token_id, ours.vocab_size) == (hf.eos_token_id, hf.bos_token_id, len(hf))
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert [ours.convert_id(i) for i in (0, 1, 2, 500, 49151)] == hf.convert_ids_to_tokens([0, 1, 2, 500, 49151])


def test_folder_tokenizer_takes_the_fast_path(tokenizer_dir):
    """A folder transformers saved (the test checkpoints, .asmodel contents) loads without transformers too."""
    ours = Tokenizer.load(tokenizer_dir)
    assert ours._fast is not None and ours._hf is None
    assert ours.encode("Hello world") == ours.hf.encode("Hello world")


def test_folder_transformers_would_change_loads_through_transformers(tokenizer_dir, tmp_path):
    """add_bos_token in tokenizer_config.json can make transformers rebuild the post-processor: such a folder is not
    read by the fast path, and encodes as transformers does."""
    import json
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    ours = Tokenizer.load(str(folder))
    assert ours._fast is None
    from transformers import AutoTokenizer

    assert ours.encode("Hello") == AutoTokenizer.from_pretrained(str(folder)).encode("Hello")


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_model_chat_template_matches_transformers(tokenizers, conversation, generation_prompt):
    ours, hf = tokenizers
    want = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt) == want


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.mark.parametrize("name,template,kwargs", [
    ("chatml", CHATML_TOOLS, {}),
    ("chatml-tools", CHATML_TOOLS, {"tools": TOOLS}),
    ("llama3", LLAMA3, {}),
    ("llama3-date", LLAMA3, {"date_string": "25 Nov 2026"}),
    ("mistral", MISTRAL, {}),
    ("data", DATA, {"extra_flag": True}),
])
def test_templates_render_as_transformers_renders_them(tokenizers, name, template, kwargs):
    _, hf = tokenizers
    special = {k: str(v) for k, v in hf.special_tokens_map.items()}
    conversations = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "tool_calls": None}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x", "reasoning": "think",
                       "tool_calls": [{"name": "f", "arguments": {"a": [1, 2.5, None, "é"]}}]}],
                     CONVERSATIONS[1][1:]]
    # ember follows newer transformers (5.24 here) where 5.17 differed: message keys set to None are dropped, and
    # `reasoning` is also given to templates as `thinking`; with an older transformers the conversation that shows
    # each is left out, since the reference there is the older behaviour
    def renders(message: dict, template: str) -> str:
        return hf.apply_chat_template([message], tokenize=False, chat_template=template).strip()

    if renders({"role": "user", "content": "x", "reasoning": "r"}, "{{ messages[0].thinking is defined }}") != "True":
        del conversations[1]
    if renders({"role": "user", "content": "x", "k": None}, "{{ messages[0].k is defined }}") != "False":
        del conversations[0]
    for conversation in conversations:
        for generation_prompt in (True, False):
            want = hf.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                          add_generation_prompt=generation_prompt, **kwargs)
            got = chat_template.render(template, conversation, special, generation_prompt, **kwargs)
            assert got == want, (name, conversation)


def test_template_errors_and_fallbacks(tokenizers):
    import jinja2

    ours, hf = tokenizers
    special = {k: str(v) for k, v in hf.special_tokens_map.items()}
    wrong_order = [{"role": "assistant", "content": "x"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="alternate"):
        chat_template.render(MISTRAL, wrong_order, special)
    with pytest.raises(jinja2.exceptions.SecurityError):
        chat_template.render("{% set ns = namespace(_x=1) %}", [], special)
    for call in ({"continue_final_message": True}, {"tools": [len]}):
        with pytest.raises(chat_template.Unsupported):
            chat_template.render(CHATML_TOOLS, CONVERSATIONS[0], special, False, **call)
    # the tokenizer hands such calls to transformers, which renders them
    final = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    want = hf.apply_chat_template(final, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert ours.apply_chat_template(final, add_generation_prompt=False, continue_final_message=True) == want
