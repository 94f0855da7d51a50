"""A seeded mutator over small valid files of every kind ember reads (GGUF as F32 and Q8_0 blocks, a Hugging Face
folder's safetensors and config.json, an .asmodel pair as float and int8, a TensorRT-LLM checkpoint, a PEFT LoRA
adapter): each file truncated, bit-flipped, or given hostile integers and JSON values, then loaded whole
(``load_model``; ``read_adapter`` for adapters). Each case must load (the mutation was harmless) or be refused with
ConfigError (BadRequestError for an adapter, which requests name) naming the file; any other exception, a crash or
a hang fails. The cases run in a child process, so that a segfault or a hang fails the test instead of pytest.

EMBER_FUZZ_CASES sets the cases a format (default 40: well under a minute in all on 2 cores); EMBER_FUZZ_SEED the
seed. ``pytest -s`` prints the counts.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
HOSTILE_INTS = (0, 1, 255, (1 << 31) - 1, 1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, (1 << 64) - 1)
HOSTILE_JSON = (0, -1, 1 << 40, 1 << 70, 1.5, float("nan"), float("inf"), "x", None, True, [], {}, [1, 2])
FORMATS = ("gguf", "safetensors", "asmodel", "trtllm", "lora")


def _cases() -> int:
    return int(os.environ.get("EMBER_FUZZ_CASES", "40"))


# ----- the seed files -----

@pytest.fixture(scope="module")
def seeds(tmp_path_factory, tokenizer_dir) -> dict[str, list[str]]:
    """format -> the paths of its valid seed files (folders or files), each loading as it is."""
    from conftest import peft_adapter
    from gguf_writer import write_gguf
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trtllm_checkpoint import write_trtllm_checkpoint

    from ember.model_loader.convert import convert
    from ember.quantization import QuantConfig

    root = tmp_path_factory.mktemp("fuzz-seeds")
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf = str(root / "hf")
    model.save_pretrained(hf)
    out = {"gguf": [], "safetensors": [hf], "asmodel": [], "trtllm": [], "lora": []}
    for qtype in ("F32", "Q8_0"):
        out["gguf"].append(str(root / f"m-{qtype}.gguf"))
        write_gguf(model, "llama", out["gguf"][-1], qtype)
    out["asmodel"].append(convert(hf, str(root / "as-f32"), "m", dtype="float32", tokenizer=tokenizer_dir))
    out["asmodel"].append(convert(hf, str(root / "as-int8"), "m", dtype="float32", tokenizer=tokenizer_dir,
                                  quant_config=QuantConfig.of("int8", 32)))
    out["trtllm"].append(write_trtllm_checkpoint(hf, str(root / "trt"), dtype="float32") or str(root / "trt"))
    out["lora"].append(str(root / "lora"))
    peft_adapter(hf, out["lora"][-1], r=4)
    return out


# ----- mutations -----

def _header_end(path: str, data: bytes) -> int:
    """Where the file's header ends: the region whose lies matter most."""
    if path.endswith(".gguf"):
        from ember.model_loader.gguf_file import GGUFFile

        f = GGUFFile(path)
        base = f.buf.__array_interface__["data"][0]
        return min(t.data.__array_interface__["data"][0] - base for t in f.tensors)
    if path.endswith((".safetensors", ".asparam")):
        return 8 + struct.unpack_from("<Q", data)[0]
    return len(data)  # JSON: all of it


def _mutate_bytes(rng: random.Random, data: bytes, header: int) -> tuple[bytes, str]:
    b = bytearray(data)
    kind = rng.choice(("truncate", "flip-header", "flip-header", "int-header", "flip-any"))
    if kind == "truncate":
        n = rng.randrange(header) if rng.random() < 0.5 else rng.randrange(len(b))
        return bytes(b[:n]), f"truncate at {n}"
    if kind == "int-header":
        pos = rng.randrange(max(1, header - 8))
        value = rng.choice(HOSTILE_INTS)
        b[pos:pos + 8] = struct.pack("<Q", value)
        return bytes(b), f"u64 {value} at {pos}"
    region = header if kind == "flip-header" else len(b)
    flips = [rng.randrange(region * 8) for _ in range(rng.randint(1, 8))]
    for bit in flips:
        b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b), f"{kind} bits {flips}"


def _mutate_json(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A hostile value at a random place of the JSON (numbers, types, a 100,000-deep nest), or its bytes mutated."""
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or rng.random() < 0.3:
        return _mutate_bytes(rng, data, len(data))
    node, path = doc, []
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            break
        key = rng.choice(keys)
        if not isinstance(node[key], (dict, list)) or rng.random() < 0.4:
            node[key] = value = rng.choice(HOSTILE_JSON) if rng.random() < 0.95 else "[" * 100_000
            path.append(key)
            text = json.dumps(doc)
            if value == "[" * 100_000:
                text = text.replace(json.dumps(value), value)
            return text.encode(), f"json {path} = {str(value)[:20]}"
        path.append(key)
        node = node[key]
    return _mutate_bytes(rng, data, len(data))


def _targets(seed: str) -> list[str]:
    """The files of a seed that cases mutate (relative to a folder seed; '' for a file seed)."""
    if os.path.isfile(seed):
        return [""] if not seed.endswith(".asmodel") else ["", "m.asparam"]
    return sorted(f for f in os.listdir(seed) if f.endswith((".safetensors", ".json")))


def _load(kind: str, path: str) -> None:
    from ember.config import ModelConfig, ModelShape
    from ember.lora.adapter import read_adapter
    from ember.model_loader import load_model

    if kind == "lora":
        shape = ModelShape(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=128,
                           max_position=64, intermediate_size=64)
        read_adapter(path, "a", shape, 64)
    else:
        load_model(ModelConfig(path, None, "float32", "cpu", None, None, None, 0, None))


def fuzz(kind: str, seeds: list[str], n: int, seed: int, work: str, progress: str) -> dict:
    """n mutated cases of a format: counts of 'loaded' and 'refused', and every case that did neither."""
    from ember.errors import BadRequestError, ConfigError

    expected = BadRequestError if kind == "lora" else ConfigError
    counts, failures = {"loaded": 0, "refused": 0}, []
    for i in range(n):
        rng = random.Random(f"{seed}-{kind}-{i}")
        src = seeds[i % len(seeds)]
        name = f"case-{kind}-{i:05d}"
        folder = os.path.join(work, name)
        if os.path.isdir(src):
            shutil.copytree(src, folder)
            case = folder
        else:  # a file seed: in a folder of its own, named after the case
            os.makedirs(folder)
            case = os.path.join(folder, name + os.path.splitext(src)[1])
            shutil.copy(src, case)
            if src.endswith(".asmodel"):  # its weights file beside it, under the name it records
                shutil.copy(os.path.join(os.path.dirname(src), "m.asparam"), folder)
        target = rng.choice(_targets(src))
        file = os.path.join(folder, target) if target else case
        with open(file, "rb") as f:
            data = f.read()
        if file.endswith((".json", ".asmodel")):
            data, how = _mutate_json(rng, data)
        else:
            data, how = _mutate_bytes(rng, data, _header_end(file, data))
        with open(file, "wb") as f:
            f.write(data)
        with open(progress, "w") as f:
            f.write(f"{name}: {os.path.basename(file)} {how}")
        try:
            _load(kind, case)
            counts["loaded"] += 1
        except expected as e:
            if name not in str(e):
                failures.append(f"{name} ({os.path.basename(file)} {how}): the error does not name the file: {e}")
            counts["refused"] += 1
        except Exception as e:  # noqa: BLE001  (what the test is for: anything else is a defect)
            failures.append(f"{name} ({os.path.basename(file)} {how}): {type(e).__name__}: {e}\n"
                            + "".join(traceback.format_exc(limit=-3)))
        shutil.rmtree(folder, ignore_errors=True)
    return {"counts": counts, "failures": failures}


def main(args_file: str) -> None:
    """The child process: every format's cases, the results written to the file beside args_file."""
    import logging

    logging.disable(logging.WARNING)  # a harmless mutation may log (a larger tokenizer, ...)
    with open(args_file) as f:
        args = json.load(f)
    results = {kind: fuzz(kind, args["seeds"][kind], args["n"], args["seed"], args["work"], args["progress"])
               for kind in FORMATS}
    with open(args["out"], "w") as f:
        json.dump(results, f)


def test_mutated_files_load_or_are_refused_by_name(seeds, tmp_path):
    n, seed = _cases(), int(os.environ.get("EMBER_FUZZ_SEED", "0"))
    work = tmp_path / "work"
    work.mkdir()
    args = {"seeds": seeds, "n": n, "seed": seed, "work": str(work), "progress": str(tmp_path / "progress"),
            "out": str(tmp_path / "out.json")}
    (tmp_path / "args.json").write_text(json.dumps(args))
    code = f"import sys; sys.path[:0] = {[HERE, TESTS]!r}; import test_fuzz_files as t; t.main(sys.argv[1])"
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "args.json")], capture_output=True,
                              text=True, timeout=max(600, 3 * n * len(FORMATS)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the fuzzer hung at {(tmp_path / 'progress').read_text()}")
    last = (tmp_path / "progress").read_text() if (tmp_path / "progress").exists() else "start-up"
    assert proc.returncode == 0, f"the fuzzer died (code {proc.returncode}) at {last}:\n{proc.stderr[-3000:]}"
    results = json.loads((tmp_path / "out.json").read_text())
    for kind, r in results.items():
        print(f"hostile files, {kind}: {n} tried, {r['counts']['loaded']} loaded, {r['counts']['refused']} refused "
              f"by name, {len(r['failures'])} failed (seed {seed})")
    failures = [f for r in results.values() for f in r["failures"]]
    assert not failures, "\n\n".join(failures[:10])
    for kind, r in results.items():  # every format saw both outcomes: the mutator reaches past the first check
        assert r["counts"]["refused"] > 0, kind
