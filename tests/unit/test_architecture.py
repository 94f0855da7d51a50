"""The three layers and their contracts: imports point one way, and a worker runs from plain, picklable batches."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
from conftest import TESTS, random_prompts
from internals import core_of, worker_of

from ember import LLM, SamplingParams

ROOT = Path(TESTS).parent / "ember"

# lowest first: a module may import its own layer and the layers below it, never one above
LAYERS = [
    ("kernels", "quantization", "distributed"),
    ("layers",),
    ("models", "model_loader"),
    ("worker",),
    ("executor",),
    ("core",),
    ("frontend",),
    ("entrypoints", "compat", "server", "benchmarks", "__init__", "__main__"),
]
# small shared modules any layer may use: records, settings and helpers that import no layer above their own
SHARED = {"envs", "errors", "dtypes", "cache", "config", "sampling_params", "outputs", "tokenizer", "version",
          "quantization.config", "layers.kv_cache", "lora", "protocol", "openmp"}
# what the clients (entrypoints, facades, server) may use of the engine: the front end's client, the shared
# records, and the model files' own tools (conversion, serialization)
CLIENT_MAY_USE = {"frontend", "model_loader"}


def _rank(module: str) -> int | None:
    top = module.split(".")[0]
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    return None


def _shared(module: str) -> bool:
    return any(module == s or module.startswith(s + ".") for s in SHARED)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every ember module imported anywhere in the file (function-level imports included), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ember"):
            names = [node.module] if node.module != "ember" else [f"ember.{a.name}" for a in node.names]
            out += [(node.lineno, n.removeprefix("ember").lstrip(".") or "__init__") for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.removeprefix("ember.")) for a in node.names if a.name.startswith("ember.")]
    return out


def test_imports_point_one_way():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        own = _rank(module)
        if own is None:  # a shared module: it may use other shared modules only
            for line, dep in _imports(path):
                if not _shared(dep) and _rank(dep) is not None and not module.startswith(dep.split(".")[0]):
                    bad.append(f"{path.relative_to(ROOT)}:{line} (shared) imports ember.{dep}")
            continue
        for line, dep in _imports(path):
            rank = _rank(dep)
            if _shared(dep) or rank is None:
                continue
            if rank > own:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports ember.{dep}, a layer above its own")
            elif own == len(LAYERS) - 1 and rank < own and dep.split(".")[0] not in CLIENT_MAY_USE:
                bad.append(f"{path.relative_to(ROOT)}:{line} is a client but imports ember.{dep}: use the "
                           "EngineClient")
    assert not bad, "\n".join(bad)


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_of(p): p for p in ROOT.rglob("*.py")}


def _target(name: str) -> str:
    """The ember module an import names: itself, or the package or module that defines the name."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _edges(path: Path, lazy: bool) -> tuple[set[str], set[str]]:
    """The ember modules and the third-party top-level packages a file imports: with ``lazy``, every import (in
    functions and TYPE_CHECKING blocks too); without, only those that run when the module is imported."""
    ember, other = set(), set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not lazy and (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                             or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))):
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [f"{child.module}.{a.name}" for a in child.names]
                if child.module.split(".")[0] == "ember":
                    ember.update(_target(n) if n in MODULES else _target(child.module) for n in names)
                else:
                    other.add(child.module.split(".")[0])
            elif isinstance(child, ast.Import):
                for a in child.names:
                    (ember.add(_target(a.name)) if a.name.split(".")[0] == "ember" else other.add(a.name.split(".")[0]))
            else:
                visit(child)

    visit(ast.parse(path.read_text()))
    return ember - {_module_of(path)}, other


def test_no_import_loops():
    """No module reaches itself through imports, counting every import: lazy ones in functions and those only for
    type checking too (a loop broken by a late import is still a loop in the design)."""
    graph = {m: _edges(p, lazy=True)[0] for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    loops: list[list[str]] = []

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                loops.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                walk(dep, path + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert not loops, "\n".join(" -> ".join(loop) for loop in loops)


def _closure(module: str) -> tuple[set[str], set[str]]:
    """Every ember module and third-party package that importing ``module`` runs (its packages' __init__ files
    included; the root ``ember`` package, the users' entry point, left out)."""
    seen, third, todo = set(), set(), [module]
    while todo:
        m = todo.pop()
        if m in seen or m == "ember":
            continue
        seen.add(m)
        deps, other = _edges(MODULES[m], lazy=False)
        third |= other
        parents = {".".join(m.split(".")[:i]) for i in range(2, m.count(".") + 1)}
        todo += [d for d in deps | parents if d in MODULES]
    return seen, third


def test_the_protocol_needs_no_torch_and_no_layer():
    """The records that cross layers can be read by a process that has neither torch nor the engine."""
    for m in [m for m in MODULES if m.startswith("ember.protocol")]:
        modules, third = _closure(m)
        assert "torch" not in third, f"{m} imports torch (through {sorted(modules)})"
        layered = [d for d in modules if _rank(d.removeprefix("ember.")) is not None
                   and not _shared(d.removeprefix("ember."))]
        assert not layered, f"{m} imports layers {layered}"


def test_config_imports_no_layer_and_no_torch():
    """The configuration is read before anything loads (and by a process that only validates settings)."""
    config = [m for m in MODULES if m == "ember.config" or m.startswith("ember.config.")]
    assert len(config) > 3  # a package: one file per concern
    for m in config:
        deps, _ = _edges(MODULES[m], lazy=True)
        layered = [d for d in deps if _rank(d.removeprefix("ember.")) is not None]
        assert not layered, f"{m} imports {layered}"
        modules, third = _closure(m)
        assert "torch" not in third, f"{m} imports torch (through {sorted(modules)})"


def test_worker_sees_no_tokenizer_and_no_front_end():
    for path in sorted(p for d in ("worker", "executor", "core", "distributed") for p in (ROOT / d).rglob("*.py")):
        for line, dep in _imports(path):
            assert not dep.startswith(("tokenizer", "frontend")), f"{path.relative_to(ROOT)}:{line} imports {dep}"


def test_facades_write_no_environment_variables():
    for path in sorted((ROOT / "compat").rglob("*.py")):
        text = path.read_text()
        assert "os.environ[" not in text and "os.putenv" not in text and "environ.update" not in text, path


def test_a_worker_replays_unpickled_batches_to_the_same_tokens(llama_dir):
    """The messages are all a worker needs: every ``SchedulerOutput`` an engine sent, pickled and replayed in order
    on a fresh worker, gives the same sampled tokens (greedy, and seeded sampling through the worker's own
    generators). A sequence goes out in full once; later steps carry only what changed."""
    from ember.worker.worker import Worker

    llm = LLM(llama_dir, dtype="float32", max_model_len=128, max_num_seqs=4, kv_cache_memory="16MiB", device="cpu")
    try:
        worker = worker_of(llm)
        seen: list[tuple[bytes, list[int]]] = []
        run = worker.execute_model

        def recording(batch):
            out = run(batch)
            seen.append((pickle.dumps(batch), list(out.token_ids)))
            return out

        worker.execute_model = recording
        vocab = llm.model_info.vocab_size
        prompts = random_prompts(3, 5, 40, vocab, seed=51)
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                  SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, n=2),
                  SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                                 prompt_logprobs=2, logprobs=1)]
        llm.generate(prompts, params, use_tqdm=False)
        config, resolved = llm.config, llm.config.resolve()
    finally:
        llm.shutdown()
    messages = [pickle.loads(blob) for blob, _ in seen]
    assert len(seen) > 3 and any(new.prompt_logprobs == 2 for m in messages for new in m.new)
    sent_new = [new.handle for m in messages for new in m.new]
    assert len(sent_new) == len(set(sent_new))  # no preemption here: every sequence is sent in full once
    decodes = [m for m in messages if m.handles and not m.new]
    assert decodes and all(set(m.new_token_ids) == set(m.handles) for m in decodes)
    fresh = Worker(resolved.model, resolved.cache)
    fresh.init_cache(config.scheduler(fresh.loaded.max_position))
    for blob, tokens in seen:
        assert fresh.execute_model(pickle.loads(blob)).token_ids == tokens


@pytest.mark.parametrize("bad, field", [(dict(temperature=float("nan")), "temperature"),
                                        (dict(top_p=float("inf")), "top_p"), (dict(temperature=None), "temperature"),
                                        (dict(n=True), "n")])
def test_bad_numbers_are_refused_with_the_field_name(bad, field):
    from ember.errors import BadRequestError

    with pytest.raises(BadRequestError, match=rf"^{field}="):
        SamplingParams(**bad)


def test_errors_keep_their_valueerror_contract(tiny_llm):
    from ember.errors import BadRequestError, EmberError

    with pytest.raises(BadRequestError, match="prompt of type NoneType is not supported"):
        tiny_llm.generate([None], use_tqdm=False)
    assert issubclass(BadRequestError, ValueError) and issubclass(BadRequestError, EmberError)
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert out[0].finished  # the engine keeps serving after a refused request


def test_backends_are_chosen_once_at_start():
    import torch

    from ember.kernels import kernels_for
    from ember.layers.attention import ATTENTION_BACKENDS, PagedAttention, bind_attention_backend
    from ember.layers.kv_cache import KVCacheFormat
    from ember.quantization import QuantizedMatmul, quantize_int8
    from ember.quantization.kernels import MATMUL_PATHS

    cpu = torch.device("cpu")
    layers = [PagedAttention(4, 2, 16) for _ in range(2)]
    float_pool = bind_attention_backend(layers, cpu, KVCacheFormat("auto", 16, torch.float32))
    assert float_pool.name == ("cpu-kernel" if kernels_for(cpu) is not None else "torch")
    assert all(layer.backend is float_pool for layer in layers)  # one instance, shared, nothing per call
    assert bind_attention_backend(layers, cpu, KVCacheFormat("int8", 16, torch.float32)).name == "torch"
    assert set(ATTENTION_BACKENDS) >= {"torch", "cpu-kernel"}
    mm = QuantizedMatmul("int8", quantize_int8(torch.randn(64, 128)))
    assert mm.path in MATMUL_PATHS and type(mm.impl) is MATMUL_PATHS[mm.path]


def test_parallel_sizes_are_checked_before_loading(llama_dir):
    from ember.config import EngineConfig
    from ember.errors import ConfigError

    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=0 is out of range"):
        EngineConfig(llama_dir, pipeline_parallel_size=0)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=True is out of range"):
        EngineConfig(llama_dir, tensor_parallel_size=True)
    with pytest.raises(AttributeError):  # frozen: what the user asked for is never rewritten
        EngineConfig(llama_dir).device = "cuda"


def test_finished_requests_leave_no_state_behind(tiny_llm):
    """Once every request has ended, neither the front end, the core nor the worker holds anything of them (the
    worker's sampling states are dropped even when the engine goes idle)."""
    import time

    from ember.errors import BadRequestError

    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=4, no_repeat_ngram_size=2)
    tiny_llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
    stream = tiny_llm.stream([5, 6, 7], SamplingParams(temperature=0.7, seed=1, max_tokens=50))
    next(stream)
    stream.close()  # leaves early: the request is aborted
    client, core, worker = tiny_llm.client, core_of(tiny_llm), worker_of(tiny_llm)
    deadline = time.monotonic() + 10
    while (worker.runner.states or core.requests or client._outputs.states) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.runner.states and not core.requests and not client._outputs.states
    with pytest.raises(BadRequestError, match="already in use"):  # ids are unique among requests in flight ...
        client.submit([[1], [2]], [None, None], lambda _: None, ["x", "x"])
    assert tiny_llm.generate([[1]], SamplingParams(max_tokens=1), use_tqdm=False)[0].finished  # ... and reusable
