"""The package and the ``ember`` command's start: ``import ember`` loads nothing heavy, its names load on first use,
and the command runs with the collector on and the start-up's modules frozen out of it (entrypoints/console.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import ember


def _child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_ember_loads_neither_torch_nor_the_engine():
    seen = _child("import json, sys, ember\n"
                  "before = sorted(m for m in ('torch', 'ember.entrypoints.llm') if m in sys.modules)\n"
                  "llm = ember.LLM\n"
                  "print(json.dumps({'before': before, 'llm': llm.__module__, 'engine': 'torch' in sys.modules}))")
    assert seen == {"before": [], "llm": "ember.entrypoints.llm", "engine": True}
    assert ember.errors.ConfigError is ember.ConfigError  # submodules stay reachable as attributes


def test_every_exported_name_resolves():
    for name in ember.__all__:
        assert getattr(ember, name) is not None, name
    assert set(ember.__all__) <= set(dir(ember))
    try:
        ember.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_console_imports_with_the_collector_off_and_runs_the_command_with_it_on():
    seen = _child("import builtins, gc, json, sys\n"
                  "at_import, real = {}, builtins.__import__\n"
                  "def spy(name, *args, **kwargs):\n"
                  "    at_import.setdefault(name, gc.isenabled())\n"
                  "    return real(name, *args, **kwargs)\n"
                  "builtins.__import__ = spy\n"
                  "from ember.entrypoints import console\n"
                  "sys.argv = ['ember', '--help']\n"
                  "try:\n"
                  "    console.run()\n"
                  "except SystemExit:\n"
                  "    pass\n"
                  "builtins.__import__ = real\n"
                  "print(json.dumps({'torch': at_import.get('torch'), 'enabled': gc.isenabled(),\n"
                  "                  'frozen': gc.get_freeze_count(),\n"
                  "                  'engine': 'ember.entrypoints.llm' in sys.modules}))")
    assert seen["torch"] is False  # torch (and the engine) imported with the collector off
    assert seen["enabled"] and seen["engine"]  # on again for the command
    assert seen["frozen"] > 10_000  # torch's and ember's modules, functions and classes
