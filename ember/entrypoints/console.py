"""The ``ember`` command's entry (and ``python -m ember``'s): the interpreter set up for a process that ember owns,
then ``cli.run``.

Importing torch and ember makes ~280,000 long-lived objects (modules, functions, classes) and no garbage worth
collecting, yet the allocation bursts of the imports and of the model's load set off collections that walk them
again and again. With the collector off during the imports and those objects then frozen (``gc.freeze``: kept out
of every later collection), the whole ``ember generate`` command on the default model takes 1.42 s instead of 1.75
(benchmarks/startup.py, 2-core AMD EPYC Zen 5, docs/benchmarks.md); the collector off without the freeze only moves
the walks into the model's load. The price: the ~7,000 objects of cyclic garbage the imports leave are frozen too,
once (collecting them first costs 0.12 s). The engine core's own process and a split model's ranks start fresh
interpreters, without this.

Only here, where the process is ember's: a program that imports ember as a library keeps its collector as it set
it (frozen objects are never collected, so freezing a host program's objects could keep its garbage for good)."""

from __future__ import annotations

import gc


def run() -> None:
    enabled = gc.isenabled()
    gc.disable()
    from ember.entrypoints import cli, llm  # noqa: F401  the command line; torch and the engine's modules

    gc.freeze()
    if enabled:
        gc.enable()
    cli.run()
