"""The architectures: one package each (its model, its training objective and its `ArchSpec`,
registered from its own `__init__`), one registry (`registry.ARCHS`), as torchtitan's model specs.

    from latentloop.archs import ARCHS, get_arch
    spec = get_arch("fbt")
    model = spec.build_model(spec.config_class(n_layer=2))

Adding an architecture: a package with its model (a `GPT` subclass and its config class), its
objective and its spec, and one line here: its name in `BUILTIN`. An architecture outside this
package registers the same way from wherever it lives: name its module in the `latentloop.archs`
entry-point group of its distribution (`toy = toyarch`, or `toy = toyarch:SPEC`), or in
`LATENTLOOP_ARCHS` (comma-separated module names), and it is imported with the registry, so every
front-end, test and benchmark that enumerates `ARCHS` sees it.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

from .registry import (
    ARCHS,
    Analysis,
    AnalysisContext,
    AnalysisOption,
    ArchSpec,
    ParamGroup,
    build_model,
    build_objective,
    get_arch,
    offering,
    option_union,
    register,
    scoring_notes,
)

BUILTIN = ("gpt", "fbt", "lrt", "rgpt", "rfbt", "mor")  # the registry line: one package each, in this order
PLUGINS_ENV = "LATENTLOOP_ARCHS"  # module names, comma-separated: architectures from outside the package
ENTRY_POINT_GROUP = "latentloop.archs"  # the same, declared by an installed distribution

for _name in BUILTIN:
    importlib.import_module(f".{_name}", __name__)


def _plugins() -> dict[str, Callable[[], Any]]:
    """Every architecture named from outside, by how it was named, with what imports it:
    `LATENTLOOP_ARCHS`' module names, then the entry points (`toy = toyarch`, or in the usual
    `module:attr` form `toy = toyarch:SPEC`: `EntryPoint.load` imports the module and takes the attribute)."""
    named: dict[str, Callable[[], Any]] = {}
    for module in (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",")):
        if module:
            named[module] = functools.partial(importlib.import_module, module)
    try:
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            named.setdefault(entry.value, entry.load)
    except Exception:  # noqa: BLE001 - a broken distribution's metadata must not stop the package loading
        pass
    return named


def _load_plugins() -> None:
    """Import every architecture module named from outside (it registers its spec, as the built-in ones
    do; an entry point's attribute that is a spec not registered by then is registered here). One
    that does not import is said in one line and left out (`import latentloop` must not fail for it:
    the other architectures still work, and a run of the missing one then fails as an unknown arch)."""
    for named, load in _plugins().items():
        try:
            found = load()
            if isinstance(found, ArchSpec) and ARCHS.get(found.name) is not found:
                register(found)
        except Exception as error:  # noqa: BLE001 - whatever the module raises: it is the user's code
            print(f"latentloop: warning: cannot import the architecture module {named!r} ({PLUGINS_ENV} or "
                  f"the {ENTRY_POINT_GROUP!r} entry points), left out: {type(error).__name__}: {error}",
                  file=sys.stderr)


_load_plugins()

__all__ = ["ARCHS", "BUILTIN", "Analysis", "AnalysisContext", "AnalysisOption", "ArchSpec", "ParamGroup", "build_model",
           "build_objective", "get_arch", "offering", "option_union", "register", "scoring_notes"]
