"""The ``ember`` command end to end on the real default model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _ember(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The installed `ember` console script of this environment."""
    script = Path(sys.executable).with_name("ember")
    assert script.exists(), "the ember console script is not installed: pip install -e ."
    return subprocess.run([str(script), *args], capture_output=True, text=True, input=stdin, timeout=300)


def test_generate_answers_capital_of_france():
    proc = _ember("generate", "What is the capital of France?", "--max-tokens", "48")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tokens/s" in proc.stderr


def test_chat_keeps_history(llama_dir, monkeypatch, capsys):
    """Each turn's prompt holds the whole conversation so far: user turns and the streamed replies."""
    from ember.entrypoints import cli
    from ember.frontend.client import EngineClient

    lines = iter(["My name is Ada.", "What is my name?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    seen: list[list[dict]] = []
    original = EngineClient.chat_prompt

    def spy(self, conversation, *a, **kw):
        seen.append([dict(m) for m in conversation])
        return original(self, conversation, *a, **kw)

    monkeypatch.setattr(EngineClient, "chat_prompt", spy)
    assert cli.main(["chat", "--model", llama_dir, "--max-tokens", "6", "--kv-cache-memory", "16MiB"]) == 0
    out = capsys.readouterr().out
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][0]["content"] == "My name is Ada." and seen[1][2]["content"] == "What is my name?"
    assert seen[1][1]["content"] and seen[1][1]["content"] in out  # the first reply, as streamed


@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_help(cmd):
    proc = _ember(cmd, "--help")
    assert proc.returncode == 0 and "--model" in proc.stdout and "--temperature" in proc.stdout


def test_bad_argument_is_a_clear_error():
    proc = _ember("generate", "hi", "--temperature", "-1")
    assert proc.returncode == 2 and "temperature" in proc.stderr


def test_generate_with_json_schema_and_regex(tmp_path, capsys):
    """--json-schema FILE and --regex constrain the reply (in process: the model loads once per call)."""
    import json

    import jsonschema

    from ember.entrypoints import cli

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert cli.main(["generate", "What is the capital of France?", "--json-schema", str(path),
                     "--max-tokens", "48"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)
    assert cli.main(["generate", "Which year did the war end?", "--regex", "[0-9]{4}", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip().isdigit()
    assert cli.main(["generate", "hi", "--json-schema", str(tmp_path / "missing.json")]) == 2  # before loading
    assert "missing.json: cannot be read" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--regex", "a("]) == 2
    assert "structured_outputs.regex cannot be compiled" in capsys.readouterr().err
