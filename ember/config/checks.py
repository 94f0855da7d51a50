"""Declarative range checks, written once: each field of a config names its rule, and ``check`` raises the one
``ConfigError`` format for all of them: ``name=value is out of range: it must be ...`` (or ``is not supported: use
one of ...`` for a choice)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Rule:
    """test(value) -> whether it is allowed; allowed: what to say it must be; choice: the message lists choices."""

    test: Callable[[Any], bool]
    allowed: str
    choice: bool = False

    def message(self, name: str, value: Any) -> str:
        if self.choice:
            return f"{name}={value!r} is not supported: use {self.allowed}"
        return f"{name}={value!r} is out of range: it must be {self.allowed}"


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int | None = None, optional: bool = False) -> Rule:
    """An int (not a bool) >= low; None too when optional."""
    text = "an integer" + (f" >= {low}" if low is not None else "") + (" or None" if optional else "")
    return Rule(lambda v: (optional and v is None) or (_int(v) and (low is None or v >= low)), text)


def number(low: float, high: float = math.inf, low_open: bool = False, optional: bool = False,
           what: str = "a number") -> Rule:
    """A finite int or float in [low, high] (or (low, high] when low_open); None too when optional."""
    span = f"in ({low:g}, {high:g}]" if low_open else f">= {low:g}" if math.isinf(high) else f"in [{low:g}, {high:g}]"
    text = f"{what} {span}" + (", or None" if optional else "")

    def test(v: Any) -> bool:
        if optional and v is None:
            return True
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
            return False
        return (v > low if low_open else v >= low) and v <= high

    return Rule(test, text)


def boolean() -> Rule:
    return Rule(lambda v: isinstance(v, bool), "True or False")


def one_of(choices: tuple[Any, ...], optional: bool = False) -> Rule:
    text = "one of " + ", ".join(repr(c) for c in choices) + (" or None" if optional else "")
    return Rule(lambda v: (optional and v is None) or v in choices, text, choice=True)


def check(config: Any, rules: dict[str, Rule]) -> None:
    """Every field with a rule, in the table's order; the first that breaks its rule raises."""
    for name, rule in rules.items():
        value = getattr(config, name)
        try:
            ok = rule.test(value)
        except TypeError:  # an unhashable value against a choice, say
            ok = False
        if not ok:
            raise ConfigError(rule.message(name, value))
