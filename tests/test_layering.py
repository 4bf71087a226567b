"""The import rules of docs/design.md ("Import rules"), checked on the source with `ast`.

Every `import` / `from ... import` of a `latentloop` module in `latentloop/**/*.py` counts, at module
level or inside a function ("lazy"), under `if TYPE_CHECKING:` too. A part is a top-level module
(`latentloop/engine.py` -> `engine`) or a subpackage (`latentloop/eval/...` -> `eval`). An import
that the table below does not allow fails, unless it is one of the documented exceptions; an
exception that no longer occurs fails too, so the document and this file change together.
`importlib.import_module` and other dynamic imports are not seen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "latentloop"

# The base: `errors` imports nothing of ours; `util` imports `errors` only; `config` imports those two;
# every other part may import all three.
BASE = frozenset({"errors", "util", "config"})

# What each part may import besides BASE (docs/design.md, "Import rules"). The comments name edges the
# design allows that no file uses today.
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "util": frozenset({"errors"}),  # a leaf: the small helpers every part may use
    "config": frozenset({"errors", "util"}),
    "checkpoint": frozenset(),
    "data": frozenset(),
    "models": frozenset(),
    "inference": frozenset({"models"}),  # acceleration applied to built models from outside; models never import it
    "objectives": frozenset({"models"}),  # models: rgpt charges FLOPs with the counter's BACKWARD_FACTOR
    "precision": frozenset(),  # bf16 on the CPU: the instructions, and the emulation where there are none
    "optim": frozenset({"precision"}),
    # one package per architecture: its model (models only: see test_an_architectures_model_imports_only_models),
    # its objective, its spec; optim for its parameter groups, inference for its fast-path cache mixin
    "archs": frozenset({"inference", "models", "objectives", "optim"}),
    "engine": frozenset({"inference", "models"}),
    # devices, precision, data preparation: below the run folders and the group
    "runtime": frozenset({"data", "precision"}),
    "distributed": frozenset({"runtime"}),  # the process group and its collectives; knows no model
    "runs": frozenset({"archs", "checkpoint", "data", "inference", "runtime"}),  # run folders: one pass down the floors
    "parallel": frozenset({"checkpoint", "distributed", "precision", "runtime"}),
    "interop": frozenset({"archs", "checkpoint", "data"}),
    "eval": frozenset({"archs", "data", "engine", "objectives", "runs", "runtime"}),
    "serve": frozenset({"archs", "data", "engine", "inference", "models", "runs", "runtime"}),
    "chat": frozenset({"data", "engine"}),
    "api": frozenset({"archs", "engine", "runs"}),
    # inference: torch's dispatch mode through inference.torch_internals (train.memory's estimate of a step);
    # models: the CPU's attention rule, which train.memory's estimate of a CPU step follows; precision: the
    # emulated bf16 linear, which that estimate runs on the meta device
    "train": frozenset({"archs", "checkpoint", "data", "distributed", "eval", "inference", "interop", "models",
                        "objectives", "optim", "parallel", "precision", "runtime"}),
    "analysis": frozenset({"archs", "checkpoint", "data", "eval", "runs", "runtime"}),  # a result names its step
    "demo": frozenset({"archs", "data", "engine", "eval", "runtime", "train"}),
    # sizing a run: the registry's model and objective, the trainer's FLOPs memo and memory estimate,
    # the run's precision
    "plan": frozenset({"archs", "runtime", "train"}),
    # and the package's root for `--version` (latentloop.__version__, the one place the version is written)
    "cli": frozenset({"__init__", "analysis", "archs", "chat", "checkpoint", "data", "demo", "distributed", "engine",
                      "eval", "interop", "plan", "runs", "runtime", "serve", "train"}),
    "__init__": frozenset({"api"}),
    "__main__": frozenset({"cli"}),
}

# Parts whose module-level imports are limited further: the rest of their imports must be lazy.
MODULE_LEVEL_ONLY: dict[str, frozenset[str]] = {
    "cli": frozenset({"errors"}),  # `latentloop --help` and argument errors import neither torch nor models
}

# The documented exceptions: (file, imported part, lazy).
EXCEPTIONS: set[tuple[str, str, bool]] = set()  # none today


@dataclass(frozen=True)
class Edge:
    file: str  # relative to the repository root
    line: int
    source: str  # the importing part
    target: str  # the imported part
    module: str  # the imported module, dotted
    lazy: bool  # inside a function (or a lambda)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.source} -> {self.module}{' (lazy)' if self.lazy else ''}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _targets(node: ast.Import | ast.ImportFrom, path: Path) -> list[str]:
    """The latentloop modules an import statement loads (a name imported from a package counts as
    its submodule when it is one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "latentloop"]
    if node.level:
        here = _module_name(path)
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.split(".")[0] != "latentloop":
        return []
    return [f"{module}.{alias.name}" if _is_module(f"{module}.{alias.name}") else module for alias in node.names]


def _imports(tree: ast.AST):
    """(import node, lazy) for every import statement, lazy when inside a function or lambda."""
    stack = [(child, False) for child in ast.iter_child_nodes(tree)]
    while stack:
        node, lazy = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def scan() -> list[Edge]:
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        source = _part(_module_name(path))
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for node, lazy in _imports(tree):
            for module in _targets(node, path):
                edges.append(Edge(rel, node.lineno, source, _part(module), module, lazy))
    return sorted(edges, key=lambda e: (e.file, e.line, e.module))


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return scan()


def test_every_part_is_documented(edges):
    parts = {e.source for e in edges} | {_part(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    unknown = sorted(parts - set(ALLOWED))
    assert not unknown, f"parts with no import rule (add them to docs/design.md and ALLOWED): {unknown}"


def test_imports_follow_the_documented_rules(edges):
    bad = []
    for e in edges:
        if e.source == e.target:
            continue
        allowed = ALLOWED.get(e.source, frozenset())
        if e.source not in ("errors", "util", "config"):
            allowed = allowed | BASE
        if e.target in allowed or (e.file, e.target, e.lazy) in EXCEPTIONS:
            continue
        bad.append(str(e))
    assert not bad, ("imports that break the rules of docs/design.md (change the import, or the rule and "
                     "the document together):\n" + "\n".join(bad))


def test_module_level_imports_of_front_ends(edges):
    bad = [str(e) for e in edges if e.source in MODULE_LEVEL_ONLY and e.source != e.target and not e.lazy
           and e.target not in MODULE_LEVEL_ONLY[e.source]]
    assert not bad, "module-level imports that must be lazy (inside the command's function):\n" + "\n".join(bad)


def test_documented_exceptions_still_exist(edges):
    present = {(e.file, e.target, e.lazy) for e in edges}
    stale = sorted(EXCEPTIONS - present)
    assert not stale, f"exceptions no longer in the code: remove them from docs/design.md and EXCEPTIONS: {stale}"


def test_no_import_cycle_at_module_level(edges):
    """Between parts, the module-level imports form no cycle (the lazy exception is the one cycle)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.source != e.target and not e.lazy:
            graph.setdefault(e.source, set()).add(e.target)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("module-level import cycle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_hf_remote_is_standalone(edges):
    """The trust_remote_code copy is exported on its own: it imports nothing of latentloop but itself."""
    bad = [str(e) for e in edges if e.file.startswith("latentloop/interop/hf_remote/")
           and not e.module.startswith("latentloop.interop.hf_remote")]
    assert not bad, "\n".join(bad)


def test_models_know_nothing_of_the_inference_package(edges):
    """Models stay plain: no model file (shared or an architecture's) imports `latentloop.inference`,
    and no C file lives beside them (the kernels are the inference package's)."""
    from latentloop.archs import ARCHS

    model_files = {spec.model_class.__module__.replace(".", "/") + ".py" for spec in ARCHS.values()}
    bad = [str(e) for e in edges if (e.file in model_files or e.file.startswith("latentloop/models/"))
           and e.target == "inference"]
    assert not bad, "\n".join(bad)
    assert not list((PACKAGE / "models").rglob("*.[ch]")), "C files belong to latentloop/inference/"


def test_an_architectures_model_imports_only_models(edges):
    """`archs/<arch>/model.py` is a model like the backbone: it imports the config, errors, util, the shared
    models and other architectures' model files only (an export ships it with exactly those), never its
    spec, objective, the optimizer or the inference package."""
    model_files = {f"latentloop/archs/{path.parent.name}/model.py" for path in (PACKAGE / "archs").glob("*/model.py")}
    assert model_files, "no architecture model files found"
    bad = [str(e) for e in edges if e.file in model_files
           and not (e.target in BASE or e.target == "models"
                    or (e.module.startswith("latentloop.archs.") and e.module.endswith(".model")))]
    assert not bad, "\n".join(bad)


def test_tasks_do_not_import_sources(edges):
    """`data.sources` resolves `task:` through `data.tasks`; tasks and the `Source` base never import sources."""
    bad = [str(e) for e in edges if e.file in ("latentloop/data/tasks.py", "latentloop/data/base.py")
           and e.module == "latentloop.data.sources"]
    assert not bad, "\n".join(bad)


DESIGN = PACKAGE.parent / "docs" / "design.md"
TABLE_HEADER = "| part | imports at module level | only lazily | allowed, unused today |"


def _design_table() -> dict[str, tuple[set[str], set[str] | None, set[str]]]:
    """docs/design.md's import table: part -> (module-level imports, lazy-only imports (None: prose,
    as cli's), allowed but unused)."""
    lines = DESIGN.read_text(encoding="utf-8").splitlines()
    start = lines.index(TABLE_HEADER) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        part, module_level, lazy, unused = (cell.strip() for cell in line.strip("|").split("|"))

        def names(cell: str) -> set[str]:
            return set() if cell in ("—", "") else {name.strip() for name in cell.split(",")}

        prose = lazy not in ("—", "") and " " in lazy.replace(", ", ",")
        rows[part.strip("`")] = (names(module_level), None if prose else names(lazy), names(unused))
    return rows


def test_the_design_pages_import_table_is_the_codes(edges):
    """Each row of docs/design.md's table says what the part imports at module level, what only lazily,
    and what its rule allows that it does not use: read from the code, so the page cannot drift."""
    table = _design_table()
    assert set(table) == set(ALLOWED), f"rows missing or extra: {sorted(set(ALLOWED) ^ set(table))}"
    wrong = []
    for part, (module_level, lazy, unused) in table.items():
        mine = [e for e in edges if e.source == part and e.target != part]
        actual_module = {e.target for e in mine if not e.lazy}
        actual_lazy = {e.target for e in mine if e.lazy} - actual_module
        allowed = ALLOWED[part] | (BASE if part not in BASE else frozenset())
        if module_level != actual_module:
            wrong.append(f"{part}: module level {sorted(module_level)}, the code {sorted(actual_module)}")
        if lazy is not None:
            if lazy != actual_lazy:
                wrong.append(f"{part}: only lazily {sorted(lazy)}, the code {sorted(actual_lazy)}")
            if unused != allowed - actual_module - actual_lazy:
                wrong.append(f"{part}: allowed, unused {sorted(unused)}, "
                             f"the rule less the code {sorted(allowed - actual_module - actual_lazy)}")
    assert not wrong, "docs/design.md's import table differs from the code:\n" + "\n".join(wrong)
