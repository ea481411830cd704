"""The package stays easy to live in: no import circles, small modules and functions, no toys shipped,
and private torch APIs only in the ``_torch_internals/`` folder. Read from the source (no import needed)."""

from __future__ import annotations

import ast
import pathlib
import re
import tokenize

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "piecewise_backend"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(path: pathlib.Path, known: set[str], type_only: bool = False) -> set[str]:
    """Modules of the package that ``path`` imports (at any level; type-checking imports only with
    ``type_only``: they make no cycle, but they do couple layers)."""
    name = _module_name(path)
    tree = ast.parse(path.read_text())
    type_only_nodes = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in type_only_nodes and not type_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package_of(name, path).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in known else base)
    return {m for m in out if m in known and m != name}


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    known = {_module_name(p) for p in MODULES}
    return {_module_name(p): _imports(p, known, type_only) for p in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the package's modules (a package's ``__init__`` re-exporting its own
    submodules is not one: importing a submodule runs it first anyway), or None."""

    def edges(module):
        return {m for m in graph[module] if not (module.startswith(m + ".") and m in graph)}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module):
        state[module] = 1
        stack.append(module)
        for nxt in sorted(edges(module)):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    assert "piecewise_backend.runtime.compiled_graph" in graph["piecewise_backend.backend"]  # the checker sees edges
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_over_400_lines_and_no_function_over_60():
    long_modules = {p.name: n for p in MODULES if (n := len(p.read_text().splitlines())) > 400}
    long_functions = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.name}:{node.lineno} {node.name}")
    assert not long_modules and not long_functions, (long_modules, long_functions)


def test_no_toy_or_timing_module_ships_in_the_package():
    assert not [p.name for p in MODULES if re.match(r"(toy_|timing)", p.name)]


def _code_without_strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, code) of each token that is not a string, f-string part or comment."""
    skip = {tokenize.STRING, tokenize.COMMENT} | {
        getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n)
    }
    with path.open("rb") as f:
        return [(t.start[0], t.string) for t in tokenize.tokenize(f.readline) if t.type not in skip]


def test_private_torch_apis_only_in_torch_internals():
    private = re.compile(
        r"^torch\._|^\.node\.expr|^\._schema\b|StorageWeakRef"
        r"|lazy_format_graph_code|^\._codegen\b"
    )
    found = []
    for path in MODULES:
        if "_torch_internals" in path.relative_to(PACKAGE).parts:
            continue
        tokens = _code_without_strings(path)
        for i in range(len(tokens)):
            dotted = "".join(t for _, t in tokens[i : i + 5])  # torch . _C . _nn
            if private.search(dotted):
                found.append(f"{path.relative_to(PACKAGE)}:{tokens[i][0]}: {dotted}")
    assert not found, "\n".join(found)


def test_every_package_folder_is_a_package():
    """``setup.cfg``'s ``find:`` ships only folders with an ``__init__.py``: a missing one drops its modules."""
    folders = {p.parent for p in MODULES}
    assert not [str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").exists()]


# -- the layout: the folder tree is the pipeline ----------------------------------------------------

#: Root modules every stage may import: the vocabulary the whole package speaks.
SHARED = {"_torch_internals", "kinds", "op_names", "config"}
#: Of those, the folders: torch's private APIs, the one place a torch upgrade is read.
SHARED_FOLDERS = {"_torch_internals"}
#: What each stage folder may import besides itself and ``SHARED`` (``backend.py``'s order: rewrite →
#: split → compiling → plan → runtime). Run time imports only the plan's types and ``ops/``; compile
#: time never imports run time.
LAYERS = {
    "fx": set(),
    "ops": set(),
    "rewrite": {"fx", "ops"},
    "split": {"fx"},
    "compiling": {"fx", "split"},
    "plan": {"fx", "ops", "rewrite", "split", "compiling"},
    "runtime": {"ops", "plan.types"},
    "observe": {"runtime", "registry"},
    "persist": {"ops", "compiling", "plan", "runtime", "registry"},  # across processes: a build and its kernels
}
#: Root modules that may import any stage: the pipeline itself, the registry of compiled graphs,
#: the package's front door and its demo.
TOP = {"backend", "registry", "", "__main__"}


def _where(module: str) -> str:
    """The stage folder (or root module) a module of the package belongs to."""
    parts = module.split(".")[1:]
    return parts[0] if parts else ""


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import that crosses the layers the wrong way."""
    found = []
    for module, imported in sorted(graph.items()):
        here = _where(module)
        if here in TOP:
            continue
        allowed = LAYERS.get(here, set())  # a shared module: nothing but the other shared ones
        for target in sorted(imported):
            there = _where(target)
            inside = target.removeprefix("piecewise_backend.")
            if there in (here, *SHARED) or there in allowed or inside in allowed:
                continue
            found.append(f"{module} -> {target}")
    return found


def test_the_package_root_holds_at_most_eight_modules_besides_the_stage_folders():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert len(root) <= 8, root
    assert set(folders) == set(LAYERS) | SHARED_FOLDERS, folders  # every folder has its place in the layering


def test_each_stage_folder_says_what_it_takes_and_gives():
    for folder in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        assert "Takes" in doc and "gives" in doc, f"{folder}/__init__.py: {doc[:80]!r}"


def test_no_import_crosses_the_layers_the_wrong_way():
    graph = _graph(type_only=True)
    assert "piecewise_backend.plan.types" in graph["piecewise_backend.runtime.compiled_graph"]  # edges seen
    assert layering_violations(graph) == []


def test_the_layering_check_refuses_a_runtime_module_that_imports_compile_time():
    """What the check would say if ``runtime/`` reached back into compile time, or the plan into run time."""
    graph = {
        "piecewise_backend.runtime.piece_runner": {"piecewise_backend.plan.types", "piecewise_backend.split.splitting"},
        "piecewise_backend.plan.making": {
            "piecewise_backend.runtime.distributed",
            "piecewise_backend.rewrite.graph_attention",
        },
        "piecewise_backend.runtime.compiled_graph": {
            "piecewise_backend.plan.making",
            "piecewise_backend.ops.prefix_attention",
        },
        "piecewise_backend.op_names": {"piecewise_backend.fx.graph_facts"},
    }
    assert layering_violations(graph) == [
        "piecewise_backend.op_names -> piecewise_backend.fx.graph_facts",
        "piecewise_backend.plan.making -> piecewise_backend.runtime.distributed",
        "piecewise_backend.runtime.compiled_graph -> piecewise_backend.plan.making",
        "piecewise_backend.runtime.piece_runner -> piecewise_backend.split.splitting",
    ]


# -- the plan is a run-time value: its module imports no stage, its objects hold no compile-time thing ---

#: Modules held to a stricter rule than their folder's: what they may import besides ``SHARED``.
VALUE_MODULES = {"plan.types": set()}


def value_module_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a value module (``plan/types.py``) outside ``SHARED``."""
    found = []
    for inside, allowed in VALUE_MODULES.items():
        module = f"piecewise_backend.{inside}"
        for target in sorted(graph.get(module, ())):
            if _where(target) not in SHARED and target.removeprefix("piecewise_backend.") not in allowed:
                found.append(f"{module} -> {target}")
    return found


def test_the_plan_types_import_no_compile_stage():
    graph = _graph(type_only=True)
    assert "piecewise_backend.kinds" in graph["piecewise_backend.plan.types"]  # edges seen
    assert value_module_violations(graph) == []


def test_the_value_module_check_refuses_a_plan_that_imports_a_stage():
    """What the check says of the ``plan/types.py`` of ``dda5f7c``, which imported the rewrite stage."""
    graph = {
        "piecewise_backend.plan.types": {
            "piecewise_backend.rewrite",
            "piecewise_backend.kinds",
            "piecewise_backend._torch_internals",
        }
    }
    assert value_module_violations(graph) == ["piecewise_backend.plan.types -> piecewise_backend.rewrite"]


#: Where a compile-time object's class lives: none may be reachable from a plan.
COMPILE_TIME = (
    "piecewise_backend.rewrite",
    "piecewise_backend.split",
    "piecewise_backend.compiling",
    "piecewise_backend.fx",
    "piecewise_backend.plan.making",
    "piecewise_backend.plan.inputs",
    "piecewise_backend.plan.padding",
    "piecewise_backend.plan.rows",
    "piecewise_backend.config",
    "torch._subclasses",
    "torch.fx.node",
    "torch.fx.experimental",
    "torch._guards",
)


def compile_time_objects(value, path: str = "plan", seen: set | None = None) -> list[str]:
    """``path: type`` of every object reachable from ``value`` (fields, containers) whose class
    belongs to compile time: a fake tensor, a graph node, a shape environment, a stage's own type,
    the user's config (run-time settings travel as ``RuntimeSettings``). The program's graph
    module is walked only for its nodes' metadata (dropped by ``FxProgram``)."""
    import dataclasses

    import torch

    seen = set() if seen is None else seen
    if id(value) in seen or value is None or isinstance(value, (str, int, float, bool, torch.dtype, torch.device)):
        return []
    seen.add(id(value))
    module = type(value).__module__
    if module.startswith(COMPILE_TIME):
        return [f"{path}: {module}.{type(value).__qualname__}"]
    if isinstance(value, torch.fx.GraphModule):
        return [
            f"{path}.{n.name}.meta"
            for gm in (value, *value.children())
            if isinstance(gm, torch.fx.GraphModule)
            for n in gm.graph.nodes
            if n.meta
        ]
    found = []
    if dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            found += compile_time_objects(getattr(value, field.name), f"{path}.{field.name}", seen)
    elif isinstance(value, dict) or hasattr(value, "items"):
        for k, v in value.items():
            found += compile_time_objects(v, f"{path}[{k!r}]", seen)
    elif isinstance(value, (tuple, list, set, frozenset)):
        for i, v in enumerate(value):
            found += compile_time_objects(v, f"{path}[{i}]", seen)
    elif hasattr(value, "__dict__") and module.startswith("piecewise_backend"):
        for k, v in vars(value).items():
            found += compile_time_objects(v, f"{path}.{k}", seen)
    return found


@pytest.fixture(scope="module")
def decode_plan():
    """The plan of a toy decode step (step scalars, padding capacities, a full-graph plan), built
    with ``compiler="eager"`` (no Inductor: fast)."""
    import torch

    from piecewise_backend import compiled_graphs, emulated_graphs
    from tests.helpers import compile_with_reference, decode_at_sizes
    from toys.models import ToyConfig, ToyLlama

    with emulated_graphs():
        compiled, reference, start = compile_with_reference(
            ToyLlama, ToyConfig(layers=1, max_batch=4), {"compiler": "eager", "capture_sizes": [2, 4]}
        )
        with torch.no_grad():
            decode_at_sizes(compiled, reference, [2, 3], steps=3)
    graphs = [g.plan for g in compiled_graphs() if g.serial > start]
    return next(plan for plan in graphs if plan.step_scalars is not None)


def test_a_plan_holds_no_compile_time_object(decode_plan):
    assert decode_plan.step_scalars is not None and decode_plan.padding.capacities  # the parts worth walking
    assert compile_time_objects(decode_plan) == []


def test_the_object_check_finds_a_fake_tensor_and_a_config_in_a_plan(decode_plan):
    """What the check says of a plan that kept a fake value (as ``dda5f7c``'s kept fake outputs and
    the fake mode) and the config beside its settings."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from piecewise_backend import PiecewiseConfig

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(__import__("torch").zeros(2))
    bad = dataclasses.replace(
        decode_plan,
        output_specs={"submod_0": fake},
        report=dataclasses.replace(decode_plan.report, attention=(PiecewiseConfig(),)),
    )
    assert compile_time_objects(bad) == [
        "plan.output_specs['submod_0']: torch._subclasses.fake_tensor.FakeTensor",
        "plan.report.attention[0]: piecewise_backend.config.PiecewiseConfig",
    ]


def test_run_time_reads_no_config_and_evaluates_no_plan_method():
    """Run time takes its options from ``plan.settings`` (never ``config``), and evaluates the
    plan's values with its own code: no plan type defines a method that computes from a proof."""
    runtime = [p for p in MODULES if p.parent.name == "runtime"]
    assert not [p.name for p in runtime if "PiecewiseConfig" in p.read_text() or ".config." in p.read_text()]
    types = ast.parse((PACKAGE / "plan" / "types.py").read_text())
    evaluating = [
        n.name
        for n in ast.walk(types)
        if isinstance(n, ast.FunctionDef)
        and any(isinstance(c, ast.Attribute) and c.attr in ("xreplace", "subs", "evalf") for c in ast.walk(n))
    ]
    assert evaluating == []


# -- the capture machinery: one room, one door, one decider ---------------------------------------

CAPTURE = "piecewise_backend.runtime.capture"
#: The modules that state a per-call rule (sizes and budget, deferral, retries, traffic, weight
#: sets) and the words a rule is spoken in. Only ``decisions.py`` asks the rules; the executors (the
#: compiled graph, full graphs, up-front capture, the capture thread) do what it says.
DECISION_RULES = {"policy", "deferral", "retries", "traffic", "weight_sets"}
DECIDER = f"{CAPTURE}.decisions"


def decision_rule_importers(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each run-time module other than the decider (and the rules' own modules)
    that imports a rule module."""
    rules = {f"{CAPTURE}.{r}" for r in DECISION_RULES}
    found = []
    for module, imported in sorted(graph.items()):
        if module in (DECIDER, CAPTURE) or module in rules or not module.startswith("piecewise_backend.runtime"):
            continue
        found += [f"{module} -> {t}" for t in sorted(imported & rules)]
    return found


def test_the_capture_machinery_is_one_folder_entered_through_its_package():
    graph = _graph()
    rooms = {m for m in graph if m.startswith(CAPTURE + ".")}
    assert {f"{CAPTURE}.{r}" for r in (*DECISION_RULES, "decisions", "piece", "up_front", "behind")} <= rooms
    through_a_side_door = [
        f"{m} -> {t}"
        for m, imported in sorted(graph.items())
        if not m.startswith(CAPTURE)
        for t in sorted(imported)
        if t.startswith(CAPTURE + ".")
    ]
    assert through_a_side_door == []
    assert not any(m.startswith(CAPTURE) for m in graph["piecewise_backend.runtime.piece_runner"] - {CAPTURE})
    # the runner and the capture of its pieces import nothing of each other but the entry, types included
    piece_imports = _graph(type_only=True)[f"{CAPTURE}.piece"]
    assert "piecewise_backend.runtime.piece_runner" not in piece_imports


def test_only_the_decider_asks_the_capture_rules():
    graph = _graph()
    assert {f"{CAPTURE}.{r}" for r in ("policy", "traffic", "weight_sets")} <= graph[DECIDER]
    assert decision_rule_importers(graph) == []
    code = {t for _, t in _code_without_strings(PACKAGE / "runtime" / "compiled_graph.py")}  # names, not prose
    rule_words = {"Miss", "CapturePolicy", "_retries", "_traffic", "agreed_refusal", "WeightSet", "is_grad_enabled"}
    assert code & rule_words == set(), "compiled_graph.py states a rule"


def test_the_decider_check_names_a_module_that_asks_a_rule_itself():
    """What the check says of a ``compiled_graph.py`` that asked retries and traffic inline (``dda5f7c``)."""
    graph = {
        "piecewise_backend.runtime.compiled_graph": {
            f"{CAPTURE}.retries",
            f"{CAPTURE}.traffic",
            "piecewise_backend.runtime.stats",
        },
        DECIDER: {f"{CAPTURE}.policy"},
    }
    assert decision_rule_importers(graph) == [
        f"piecewise_backend.runtime.compiled_graph -> {CAPTURE}.retries",
        f"piecewise_backend.runtime.compiled_graph -> {CAPTURE}.traffic",
    ]


# -- the benchmarks are a package; the toys stand on their own --------------------------------------

ROOT = PACKAGE.parent


def _imported_roots(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    return {name.split(".")[0] for name in names}


def test_nothing_under_toys_imports_the_benchmarks():
    assert [p.name for p in sorted((ROOT / "toys").glob("*.py")) if "benchmarks" in _imported_roots(p)] == []


def test_every_benchmark_runs_as_a_module_of_the_package():
    """``python -m benchmarks.<name>``: no benchmark edits ``sys.path`` or imports a sibling as a
    top-level module (the three ways the flat scripts had)."""
    bench = ROOT / "benchmarks"
    assert (bench / "__init__.py").exists()
    siblings = {p.stem for p in bench.glob("*.py")}
    found = []
    for path in sorted(bench.glob("*.py")):
        code = "".join(t for _, t in _code_without_strings(path))
        if "sys.path.insert" in code.replace("\n", "") or "syspath.insert" in code:
            found.append(f"{path.name}: edits sys.path")
        found += [f"{path.name}: imports {m} as a top-level module" for m in _imported_roots(path) & siblings]
    by_path = re.compile(
        r"cd benchmarks\b|(python3?|torchrun[^\n]*?)\s+(benchmarks/)?\w+\.py\b|^\s*benchmarks/\w+\.py\b"
    )
    for script in sorted(bench.glob("*.sh")):  # the device scripts run them the same way
        found += [
            f"{script.name}:{n}: {line.strip()}"
            for n, line in enumerate(script.read_text().splitlines(), 1)
            if by_path.search(line) and not line.lstrip().startswith("#")
        ]
    assert found == []
