"""The layers of docs/architecture.md, enforced: the import graph of kvaudit/ (every import, top level and
inside functions, relative ones resolved) has no cycle and no import that goes up the stated order."""

import ast
import os
import re
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("eut", "sglang", "vllm")


def stated_order() -> dict[str, int]:
    """Room -> rank, from the ```layers block of docs/architecture.md (one line per rank)."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        block = re.search(r"```layers\n(.*?)```", f.read(), re.S).group(1)
    return {room: rank for rank, line in enumerate(block.splitlines()) for room in line.split()}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "kvaudit"
    if parts[1] == "targets" and len(parts) > 2 and parts[2] in KINDS:
        return f"targets.{parts[2]}"
    return parts[1]


def import_graph(root: str) -> dict[str, set[str]]:
    """Module -> the kvaudit modules it imports, for every .py file under ``root``/kvaudit."""
    files = {}
    for d, _, names in os.walk(os.path.join(root, "kvaudit")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(d, name)
                mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                files[mod.removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:  # the module a dotted name lives in (a package, a module, or its attribute)
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        out = graph.setdefault(mod, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name == "kvaudit" or name.startswith("kvaudit."):
                    target = resolve(name)
                    if target is not None and target != mod:
                        out.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def against_order(graph: dict[str, set[str]], order: dict[str, int]) -> list[str]:
    """Every import from a room to a higher one, or between two peers of one rank."""
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            ra, rb = room(a), room(b)
            if ra != rb and order[rb] >= order[ra]:
                bad.append(f"{a} -> {b} ({ra} is below {rb})" if order[rb] > order[ra] else
                           f"{a} -> {b} ({ra} and {rb} are peers)")
    return bad


def test_every_room_of_the_package_is_in_the_stated_order():
    order = stated_order()
    rooms = {room(m) for m in import_graph(ROOT)}
    assert rooms - set(order) == set(), "add the new room to docs/architecture.md's layers"
    assert len(rooms) > 15  # the graph was built (a wrong root would give an empty set)


def test_the_package_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert sum(map(len, graph.values())) > 300  # function-level imports included
    assert cycles(graph) == []


def test_no_import_goes_up_the_stated_order():
    assert against_order(import_graph(ROOT), stated_order()) == []


@pytest.fixture
def copy(tmp_path):
    """A copy of kvaudit/ to plant imports into."""
    shutil.copytree(os.path.join(ROOT, "kvaudit"), tmp_path / "kvaudit",
                    ignore=shutil.ignore_patterns("__pycache__", "templates"))
    return tmp_path


def _plant(copy, rel: str, line: str) -> None:
    path = copy / "kvaudit" / rel
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")


def test_a_planted_function_level_upward_import_is_caught(copy):
    _plant(copy, "program/ops.py", "from kvaudit.reports.report import summary_line  # noqa")
    bad = against_order(import_graph(str(copy)), stated_order())
    assert bad == ["kvaudit.program.ops -> kvaudit.reports.report (program is below reports)"]


def test_a_planted_cycle_is_caught(copy):
    # audit.runner imports the registry (down); the registry importing the runner back closes a circle
    _plant(copy, "targets/registry.py", "from kvaudit.audit import runner  # noqa")
    graph = import_graph(str(copy))
    found = cycles(graph)
    assert len(found) == 1 and {"kvaudit.targets.registry", "kvaudit.audit.runner"} <= set(found[0])


def test_a_relative_import_between_peers_is_caught(copy):
    _plant(copy, "targets/vllm/config.py", "from ..sglang import config  # noqa")
    bad = against_order(import_graph(str(copy)), stated_order())
    assert bad == [f"kvaudit.targets.vllm.config -> kvaudit.targets.sglang{m} (targets.vllm and targets.sglang are peers)"
                   for m in ("", ".config")]  # the package, then the module imported from it


def _names_a_kind(node, kinds=KINDS) -> bool:
    """A string constant naming one of ``kinds``, or a tuple/list/set literal holding one."""
    if isinstance(node, ast.Constant):
        return node.value in kinds
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_a_kind(e, kinds) for e in node.elts)


ENGINES = ("sglang", "vllm")  # the real engines' kinds (the built-in one, eut, is the zoo's and atheris')


def engine_knowledge_outside_targets(root: str) -> list[str]:
    """Every module outside kvaudit/targets/ that imports a target kind (its import graph, function-level
    imports included), compares a value to a target kind's name (``x == "vllm"``, ``x != "eut"``,
    ``x in ("sglang", ...)``), keys a dict literal by one (``{"vllm": ...}``), passes a real engine's to a
    call (``note_for("sglang", ...)``) or names its corpus in a string (``"corpora/sglang"``; docstrings
    aside): engine knowledge lives
    under ``kvaudit/targets/<kind>/``, reached through the kind's registry entry (docs/architecture.md)."""
    bad = [f"{a} imports {b}" for a, targets in sorted(import_graph(root).items()) if not room(a).startswith("targets")
           for b in sorted(targets) if room(b).startswith("targets.")]
    base = os.path.join(root, "kvaudit")
    for d, _, names in sorted(os.walk(base)):
        rel_dir = os.path.relpath(d, base)
        if rel_dir == "targets" or rel_dir.startswith("targets" + os.sep):
            continue
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(d, name)
            rel = os.path.relpath(path, root)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            docs = {id(n.body[0].value) for n in ast.walk(tree)
                    if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Compare) and any(_names_a_kind(x) for x in [node.left, *node.comparators]):
                    bad.append(f"{rel}:{node.lineno} compares to an engine name")
                elif isinstance(node, ast.Dict) and any(k is not None and _names_a_kind(k) for k in node.keys):
                    bad.append(f"{rel}:{node.lineno} keys a dict by engine name")
                elif isinstance(node, ast.Call) and any(_names_a_kind(a, ENGINES) for a in
                                                        [*node.args, *(k.value for k in node.keywords)]):
                    bad.append(f"{rel}:{node.lineno} passes an engine name")
                elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                      and re.search(r"corpora/(%s)\b" % "|".join(ENGINES), node.value)):
                    bad.append(f"{rel}:{node.lineno} names an engine's corpus")
    return bad


def test_no_module_outside_the_targets_imports_a_target_kind_or_branches_on_an_engine_name():
    assert engine_knowledge_outside_targets(ROOT) == []


def test_a_planted_engine_branch_and_kind_import_are_caught(copy):
    _plant(copy, "export/plan.py", "from kvaudit.targets.vllm import config  # noqa")
    _plant(copy, "app/configs.py", "return 1 if registry.DEFAULT_KIND in ('eut', 'x') else {'sglang': 2}")
    _plant(copy, "reports/sarif.py", "return getattr(object, 'target', '') != \"vllm\"")
    _plant(copy, "history/suite.py", "return note_for('sglang', [], preset=''), f'corpora/vllm/{x}'")
    bad = [re.sub(r":\d+ ", " ", b) for b in engine_knowledge_outside_targets(str(copy))]
    assert bad == ["kvaudit.export.plan imports kvaudit.targets.vllm",
                   "kvaudit.export.plan imports kvaudit.targets.vllm.config",
                   "kvaudit/app/configs.py compares to an engine name", "kvaudit/app/configs.py keys a dict by engine name",
                   "kvaudit/history/suite.py passes an engine name", "kvaudit/history/suite.py names an engine's corpus",
                   "kvaudit/reports/sarif.py compares to an engine name"]


MAX_FUNCTION_LINES = 80  # issue 35: no function of kvaudit/ longer (engine_under_test's SGLang-modelled ones aside)


def long_functions(root: str) -> list[str]:
    """``path:line name (N lines)`` for every function or method under ``root``/kvaudit longer than
    :data:`MAX_FUNCTION_LINES` (its ``def`` line to its last, docstring included, decorators not)."""
    out = []
    for d, _, names in os.walk(os.path.join(root, "kvaudit")):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(d, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                for n in ast.walk(tree):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = n.end_lineno - n.lineno + 1
                        if lines > MAX_FUNCTION_LINES:
                            out.append(f"{os.path.relpath(path, root)}:{n.lineno} {n.name} ({lines} lines)")
    return out


def test_no_function_is_longer_than_80_lines():
    assert long_functions(ROOT) == []


def test_a_planted_long_function_is_caught(copy):
    _plant(copy, "search/fuzz.py", "\n    ".join(["x = 1"] * 80))
    assert [re.sub(r":\d+ ", " ", b) for b in long_functions(str(copy))] == [
        "kvaudit/search/fuzz.py _planted (81 lines)"]
