"""Inference options an architecture declares: one `DecodeOption` per knob of its decoding and
scoring (fbt's `regime`, rgpt's `steps`, ...).

Front-ends derive their fields from these declarations instead of re-listing them: CLI flags,
evaluation options, the lm-eval `model_args` and the server's request fields. The engine checks
the options of a call once, with `check_options`, and hands the model a complete dict (defaults
filled in), so a model never re-validates per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class AppliesIf:
    """An option means something only while another option's value passes `test` (fbt's passes
    under regime fused, rgpt's min_steps under an exit threshold above 0); given otherwise, it is
    refused rather than silently ignored."""
    other: str
    test: Callable[[Any], bool]
    what: str  # the condition as a message names it after the other option's name: "'fused'", "> 0"
    example: Any  # a value of `other` under which it applies (the contract suite's grid uses it)

    def holds(self, options: dict[str, Any]) -> bool:
        return self.test(options.get(self.other))


def when_one_of(other: str, values: tuple) -> AppliesIf:
    return AppliesIf(other, lambda value: value in values, " / ".join(map(repr, values)), values[0])


def when_above(other: str, bound: float, example: float) -> AppliesIf:
    return AppliesIf(other, lambda value: value is not None and value > bound, f"> {bound:g}", example)


@dataclass(frozen=True)
class DecodeOption:
    name: str
    kind: type  # int, float or str
    default: Any  # None: the model decides (e.g. rgpt's trained depth)
    help: str
    choices: tuple[str, ...] = ()  # allowed values of a str option
    minimum: float | None = None
    maximum: float | None = None  # bounds work that grows with the value (passes, steps)
    keywords: tuple[str, ...] = ()  # words accepted besides numbers (fbt passes: "auto")
    needs_cache: Callable[[Any], bool] | None = None  # value -> only meaningful with the KV cache
    applies_if: AppliesIf | None = None  # another option's values this one needs
    # value -> the cache approximates what the reference path computes (rgpt's mean / last core caches
    # keep less than every step's keys): cached decoding is then its own function, not the reference's
    approximates: Callable[[Any], bool] | None = None
    # value -> the work is decided for the whole batch (e.g. "until every row settled"), so a row
    # in a batch may decode differently from the same row alone; servers then decode it alone
    couples_rows: Callable[[Any], bool] | None = None
    # the option changes how fast the output comes, never what it is (self-speculative decoding's draft):
    # a decoder that cannot use it (the server's continuous batching) may decode without it
    speed_only: bool = False

    def exact_with_cache(self, value: Any) -> bool:
        """Whether cached decoding with this value computes what the uncached reference path computes."""
        return self.approximates is None or not self.approximates(value)

    @property
    def help_text(self) -> str:
        """The help with the condition it applies under (what `--help` and the chat page show)."""
        condition = self.applies_if
        return self.help + ("" if condition is None else f"; only with {condition.other} {condition.what}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, text: Any) -> Any:
        """A value from text (CLI flag, lm-eval model_args, query string); checked."""
        if isinstance(text, str) and self.kind is not str:
            if text in self.keywords:
                return text
            try:
                number = float(text) if self.kind is float else int(text)
            except ValueError:
                raise ConfigError(f"{self.name} must be {self.describe()}, got {text!r}") from None
            return self.check(number)
        return self.check(text)

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        what = {int: "an integer", float: "a number", str: "a string"}[self.kind]
        if self.minimum is not None and self.maximum is not None:
            what += f" in [{self.minimum:g}, {self.maximum:g}]"
        elif self.minimum is not None:
            what += f" >= {self.minimum:g}"
        return what + "".join(f" or {word!r}" for word in self.keywords)

    def check(self, value: Any) -> Any:
        """The value itself when it is valid, else a one-line ConfigError."""
        if isinstance(value, str) and value in self.keywords:
            return value
        valid_type = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
                      float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                      str: lambda v: isinstance(v, str)}[self.kind]
        if not valid_type(value) or (self.choices and value not in self.choices) \
                or (self.minimum is not None and value < self.minimum) \
                or (self.maximum is not None and value > self.maximum):
            raise ConfigError(f"{self.name} must be {self.describe()}, got {value!r}")
        return float(value) if self.kind is float else value


def check_options(declared: Sequence[DecodeOption], given: dict[str, Any], arch: str,
                  cached: bool = True) -> dict[str, Any]:
    """Every declared option with its value (given, else its default), each checked once.

    `None` values count as not given. Unknown names, invalid values, an option given where the
    option it depends on says it does not apply, and cache-only values with `cached=False` raise
    one-line ConfigErrors.
    """
    by_name = {option.name: option for option in declared}
    given = {name: value for name, value in given.items() if value is not None}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        raise ConfigError(f"arch {arch!r} does not support option(s): {', '.join(unknown)}"
                          + (f" (it has: {', '.join(by_name)})" if by_name else ""))
    options = {name: option.check(given[name]) if name in given else option.default
               for name, option in by_name.items()}
    for name in given:
        option = by_name[name]
        condition = option.applies_if
        if condition is not None and not condition.holds(options):
            raise ConfigError(f"{name} applies to {condition.other} {condition.what} only "
                              f"({condition.other} is {options[condition.other]!r})")
        if not cached and option.needs_cache is not None and option.needs_cache(options[name]):
            raise ConfigError(f"{name}={options[name]!r} needs the cache (the uncached reference path "
                              f"does not support it)")
    return options


def couples_rows(declared: Sequence[DecodeOption], options: dict[str, Any]) -> bool:
    """Whether a declaration says these options couple the rows of a prefill (fbt's `passes="auto"`
    runs until every row has settled): a row's numbers then depend on the rows beside it."""
    return any(option.couples_rows is not None and option.couples_rows(options.get(option.name))
               for option in declared)


def without_speed_only(declared: Sequence[DecodeOption], options: dict[str, Any]) -> dict[str, Any]:
    """`options` without those `declared` speed-only (self-speculative decoding's draft): the same
    output function, as a decoder that cannot use them (or a draft's plain step) runs it."""
    speed_only = {option.name for option in declared if option.speed_only}
    return {name: value for name, value in options.items() if name not in speed_only}


def all_options(declarations: Iterable[tuple[str, Sequence[DecodeOption]]]
                ) -> dict[str, tuple[DecodeOption, list[str]]]:
    """Union of several architectures' options by name: {name: (option, archs declaring it)}."""
    union: dict[str, tuple[DecodeOption, list[str]]] = {}
    for arch, options in declarations:
        for option in options:
            union.setdefault(option.name, (option, []))[1].append(arch)
    return union
