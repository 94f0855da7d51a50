"""Starts a real ``ember serve`` process on 127.0.0.1 for the server tests and stops it afterwards."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ember.benchmarks.http import free_port, post  # noqa: F401  (post: the tests' raw HTTP client)

READY = re.compile(r"ready on (http://\S+)")
# small engine limits keep start-up (warm-up at max_num_seqs x max_model_len, and a prefill of the step's token
# budget) short; the tests' prompts are short, longer ones are prefilled in chunks
TEST_ENGINE_ARGS = ("--max-num-seqs", "16", "--max-model-len", "1024", "--max-num-batched-tokens", "512", "--dtype",
                    "float32")


# a Hermes-style chat template (tools in the system turn, <tool_call> blocks, tool results as <tool_response>;
# enable_thinking opens a <think> block), written for the tests: the tool-call and reasoning formats of Qwen's
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}\n</tools>\nAnswer a call as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking %}<think>\n{%- endif %}{%- endif %}"
    "{#- replies may think first: <think>...</think> #}")


def hermes_model(tokenizer_dir: str, out: str) -> str:
    """A random-initialised tiny Llama (1,024 positions) with HERMES_TEMPLATE as its chat template."""
    from conftest import make_tiny_model

    make_tiny_model("llama", out, tokenizer_dir, max_position=1024)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:  # transformers' file for the template
        f.write(HERMES_TEMPLATE)
    return out


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    lines: list[str] = field(default_factory=list)  # everything the server printed so far

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return "".join(self.lines)


@contextmanager
def running_server(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
                   command: Callable[[int], list[str]] | None = None) -> Iterator[ServerProcess]:
    """``python -m ember serve --port FREE *args`` (or ``command(FREE)``, another program printing ember's
    readiness line); yields once the readiness line is printed; SIGTERM at exit."""
    port = free_port()
    cmd = command(port) if command else [sys.executable, "-m", "ember", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    server = ServerProcess(proc, "")
    ready = threading.Event()

    def pump() -> None:  # keep reading so the pipe never fills; note the readiness line
        for line in proc.stdout:
            server.lines.append(line)
            m = READY.search(line)
            if m:
                server.url = m.group(1).rstrip("/")
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.5):
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{cmd} did not get ready in {timeout} s:\n{server.log()}")
    if not server.url:
        proc.wait(10)
        raise RuntimeError(f"{cmd} exited ({proc.returncode}) before it was ready:\n{server.log()}")
    try:
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss
