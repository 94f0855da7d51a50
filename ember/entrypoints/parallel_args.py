"""The -tp / -pp / executor options, defined once for the commands that start an engine: its own module, so the
bench's parser (``ember.benchmarks.bench``) need not import the CLI that imports it (no import loop)."""

from __future__ import annotations

from ember.config import EXECUTOR_BACKENDS


def add_parallel_args(g) -> None:
    """-tp / -pp / --distributed-executor-backend, shared by generate, chat and bench."""
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="ranks each layer is split over (attention heads, MLP, vocabulary); default 1")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages the layers are split into; default 1")
    g.add_argument("--distributed-executor-backend", default=None, choices=list(EXECUTOR_BACKENDS),
                   help="how the ranks start: mp (local processes, the default for more than one rank), launched "
                        "(torchrun / mpirun / srun started them), ray, uni (one rank)")
