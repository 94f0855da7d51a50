"""``ember bench report``: docs/results.md comes from the records in docs/bench and cannot drift from
them. Fast: no model, no engine (fixture records are shaped as ``ember bench --out`` writes them)."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import TESTS

from ember.benchmarks import current
from ember.entrypoints.cli import main

ROOT = os.path.dirname(TESTS)
DOCS = os.path.join(ROOT, "docs")
BENCH = os.path.join(DOCS, "bench")
DOC = os.path.join(DOCS, "results.md")  # generated
TARGETS = os.path.join(DOCS, "benchmarks.md")  # hand-written: method and targets
MACHINE = {"cpu": "Test CPU", "cores": 2, "python": "3.11.7", "torch": "2.13.0+cpu"}


def _throughput(date: str, tok_s: dict[str, list[float]], **extra) -> dict:
    """A throughput record as bench.run_bench writes it: every run, the medians, ember's ratio over each backend."""
    runs = {b: [{"requests_per_s": v / 100, "output_tokens_per_s": v, "total_tokens_per_s": 3 * v, "wall_s": 1e4 / v,
                 "output_tokens": 8278, "prompt_tokens": 16799, "peak_rss_mib": 1000.0 + i, "load_s": 1.0}
                for i, v in enumerate(vs)] for b, vs in tok_s.items()}
    med = {b: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]} for b, rs in runs.items()}
    ratios = {b: med["ember"]["output_tokens_per_s"] / f["output_tokens_per_s"] for b, f in med.items()}
    record = {"mode": "throughput", "machine": dict(MACHINE, date=date), "model": "/models/tiny.gguf",
              "backends": list(tok_s), "dtypes": {b: "bfloat16" for b in tok_s}, "threads": 2, "repeats": 3,
              "seed": 0, "command": "ember bench throughput --workload W1 --backends " + ",".join(tok_s),
              "workload": "W1", "workload_description": "mixed: 64 requests", "num_requests": 64,
              "versions": {b: "v1" for b in tok_s}, "runs": runs, "median": med, "ember_over": ratios}
    record.update(extra)
    return record


def _latency(date: str) -> dict:
    def fig(tok_s: float) -> dict:
        return {"ttft_ms_median": 15.5, "ttft_ms_p99": 18.7, "tpot_ms_median": 1e3 / tok_s,
                "tpot_ms_p99": 1e3 / tok_s + 0.1, "decode_tokens_per_s": tok_s, "output_tokens": 128, "runs": 5}

    med = {"ember": {"peak_rss_mib": 1401.0, "load_s": 2.0, "prompt_32": fig(200.0)},
           "llamacpp": {"peak_rss_mib": 205.0, "load_s": 0.5, "prompt_32": fig(160.0)}}
    return {"mode": "latency", "machine": dict(MACHINE, date=date), "model": "/models/tiny.gguf",
            "backends": ["ember", "llamacpp"], "dtypes": {"ember": "bfloat16", "llamacpp": "gguf"}, "threads": 2,
            "repeats": 1, "seed": 0, "command": None, "versions": {}, "runs": {b: [f] for b, f in med.items()},
            "median": med, "ember_over": {"ember": {"prompt_32": 1.0}, "llamacpp": {"prompt_32": 1.25}}}


@pytest.fixture
def records(tmp_path):
    bench = tmp_path / "docs" / "bench"
    bench.mkdir(parents=True)

    def write(name: str, obj) -> None:
        (bench / name).write_text(json.dumps(obj))

    write("old-W1.json", _throughput("2026-01-01T00:00:00", {"ember": [100, 101, 99], "vllm": [100, 100, 100]}))
    write("new-W1.json", _throughput("2026-02-01T00:00:00", {"ember": [520, 500, 510], "ember-float": [340] * 3,
                                                             "vllm": [408, 410, 390]}))
    # newer, but ember against its own variant only: an ablation, not a result
    write("ablation-W1.json", _throughput("2026-03-01T00:00:00", {"ember": [1] * 3, "ember-variant": [2] * 3}))
    # the same workload on another machine is a table of its own
    write("gpu-W1.json", _throughput("2025-01-01T00:00:00", {"ember": [900] * 3, "hf": [300] * 3},
                                     machine=dict(MACHINE, date="2025-01-01T00:00:00", gpu="Test GPU")))
    write("lat.json", _latency("2026-02-02T00:00:00"))
    write("other-script.json", {"accuracy": {}, "speed": {}})   # not a record of ember bench: ignored
    (bench / "new-W1.png").write_bytes(b"\x89PNG")
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Reproduce\n\nhand-written method\n")
    return bench, doc


def test_the_newest_record_per_machine_model_and_workload(records):
    bench, doc = records
    chosen = current.current(current.load(str(bench)))
    assert [os.path.basename(e.path) for e in chosen] == ["new-W1.json", "lat.json", "gpu-W1.json"]
    text = current.render(str(bench), str(doc))
    assert text.startswith(current.BEGIN) and text.rstrip().endswith(current.END)
    assert "old-W1" not in text and "ablation-W1" not in text and "other-script" not in text
    # backends as rows, medians with each repeat's figure, ember's ratio over each
    assert "| ember | 510.0 (520, 500, 510) |" in text
    assert "| ember (float weights) | 340.0 (340, 340, 340) |" in text and "| 1.50x |" in text
    assert "| vLLM-CPU | 408.0 (408, 410, 390) |" in text and "| 1.25x |" in text
    assert "| llama.cpp | 32 | 15.5 / 18.7 | 6.25 / 6.35 | 160.0 (160.0) | 205 | 1.25x |" in text
    # the setup the record holds, the chart where there is one, what the record lacks said so (prose is wrapped)
    flat = re.sub(r"(?<=\S)\n(?=\S)", " ", text)
    assert "Recorded 2026-02-01T00:00:00; torch 2.13.0+cpu" in flat  # the CPU and cores in the heading
    assert "[new-W1.json](bench/new-W1.json)" in flat and "![tiny.gguf: W1 throughput](bench/new-W1.png)" in flat
    assert "Command: not recorded." in flat and "1 repeat;" in flat and "dtype bfloat16 (llamacpp gguf)" in flat
    assert "No chart in docs/bench for this record." in flat
    assert text.index("### CPU: Test CPU, 2 cores") < text.index("### GPU: Test GPU")


def test_cpus_of_one_model_name_are_told_apart_by_family_and_model(tmp_path):
    """A cloud VM names Zen 4 and Zen 5 alike ("AMD EPYC"): records carry the x86 family and model (report.machine
    reads /proc/cpuinfo's first processor), so each CPU's figures get a table of their own; a record from before
    (no cpu_id) keeps the bare name's table."""
    from ember.benchmarks import report

    info = report.machine()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            if "cpu family" in f.read():  # x86 Linux
                assert re.fullmatch(r"family \d+ model \d+", info["cpu_id"]), info
    bench = tmp_path / "bench"
    bench.mkdir()
    for name, date, cpu_id in (("zen4.json", "2026-02-01T00:00:00", "family 25 model 17"),
                               ("zen5.json", "2026-02-02T00:00:00", "family 26 model 2"),
                               ("before.json", "2026-01-01T00:00:00", None)):
        machine = dict(MACHINE, cpu="AMD EPYC", date=date) | ({"cpu_id": cpu_id} if cpu_id else {})
        (bench / name).write_text(json.dumps(_throughput(date, {"ember": [1, 2, 3], "vllm": [1, 1, 1]},
                                                         machine=machine)))
    chosen = current.current(current.load(str(bench)))
    assert sorted(e.kind for e in chosen) == ["CPU: AMD EPYC (family 25 model 17), 2 cores",
                                              "CPU: AMD EPYC (family 26 model 2), 2 cores", "CPU: AMD EPYC, 2 cores"]


def test_the_command_writes_and_checks_the_block_between_the_markers(records, capsys):
    bench, doc = records
    args = ["bench", "report", "--dir", str(bench), "--doc", str(doc)]
    assert main([*args, "--check"]) == 1
    assert main([*args, "--docs"]) == 0
    written = doc.read_text()
    assert written.startswith("# Benchmarks\n\n## Reproduce\n\nhand-written method\n\n" + current.BEGIN)
    assert main([*args, "--check"]) == 0
    # hand-written text after the block stays; a second run changes nothing
    assert written.endswith(current.END + "\n")
    doc.write_text(written + "\n## Notes\n\nkept\n")
    (bench / "new-W1.json").unlink()
    assert main([*args, "--check"]) == 1
    assert main([*args, "--docs"]) == 0
    again = doc.read_text()
    assert "new-W1" not in again and "old-W1.json" in again
    assert again.endswith(current.END + "\n\n## Notes\n\nkept\n")
    assert main([*args, "--docs"]) == 0 and doc.read_text() == again
    capsys.readouterr()
    assert main([*args]) == 0 and capsys.readouterr().out == current.render(str(bench), str(doc))


def test_docs_results_md_is_what_docs_bench_gives():
    with open(DOC) as f:
        doc = f.read()
    assert current.generated_block(doc) == current.render(BENCH, DOC), \
        "docs/results.md's tables differ from docs/bench: run `ember bench report --docs`"


def test_the_targets_quote_the_current_tables():
    with open(TARGETS) as f:
        doc = f.read()
    targets = doc[doc.index("## Targets"):doc.index("\nStart-up (")]
    with open(DOC) as f:
        block = current.generated_block(f.read())
    rows = [line.split("|")[2] for line in targets.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows
    for figure in re.findall(r"(?<![\w.])\d+(?:\.\d+)?x?(?![\w.])", "".join(rows)):
        assert re.search(rf"(?<![\w.]){re.escape(figure)}(?![\w.])", block), f"{figure} is not in the tables"


def test_every_docs_bench_file_the_docs_cite_exists():
    cited = set()
    for name in sorted(os.listdir(DOCS)) + ["../README.md"]:
        if not name.endswith(".md"):
            continue
        with open(os.path.join(DOCS, name)) as f:
            text = f.read()
        # links and paths (bench/x.json, docs/bench/lora/), and the dated names listed after one
        cited |= set(re.findall(r"(?<![\w./-])(?:docs/)?bench/([\w./-]*[\w/])", text))
        cited |= set(re.findall(r"(?<![\w./-])([\w.-]+-20\d\d-\d\d-\d\d\w*\.(?:json|png|jsonl))", text))
    assert "serving-http-W1.json" in cited and "lora/" in cited
    missing = sorted(c for c in cited if not os.path.exists(os.path.join(BENCH, c)))
    assert not missing, f"cited in docs but not in docs/bench: {missing}"
