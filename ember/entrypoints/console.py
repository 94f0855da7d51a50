"""The ``ember`` command's entry (and ``python -m ember``'s): the interpreter set up for a process that ember owns,
then ``cli.run``.

Importing torch and ember makes ~280,000 long-lived objects (modules, functions, classes) and no garbage worth
collecting, yet every allocation burst sets off a collection that walks them, over and over through start-up and
serving. With the collector off during the imports and those objects then frozen (``gc.freeze``: kept out of
every later collection), ``ember generate`` on the default model starts ~0.13 s sooner on a 2-core AMD EPYC (Zen 5).
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
