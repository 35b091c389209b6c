"""The house rules of issue 22, checked on the source (no imports run):

- the libraries under the services (router, prefix_store, transfer, kernels,
  observability) never import ``services``, not even lazily;
- and issue 39's: nothing under pdcluster/ imports ``bench`` (a command that
  runs it loads it by name through pdcluster/services/cli/checkout.py, the one
  door); ``pdcluster.planning`` imports neither ``services`` nor ``bench``;
- no import circle among modules, lazy imports inside functions included, and
  none among packages (bench, pdcluster.planning, pdcluster.services.<room>);
- outside pdcluster/kernels/, kernels are reached only through ``pdcluster.kernels.ops`` (and
  ``pdcluster.kernels.kv_quant`` for the KV pool's format names, see below);
- the gateway's rooms (services/gateway, services/openai) never import the
  engine: what both sides share is the contract at services/ root;
- no bench module is named like a standard-library module or a top-level
  package, so ``python bench/<room>/<x>.py`` cannot shadow one."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ROOT = "pdcluster"  # the one import root of the product (issue 39): no generic top-level names
PRODUCT = ("services", "planning", "router", "prefix_store", "transfer", "kernels", "observability")
PACKAGES = tuple(f"{ROOT}/{p}" for p in PRODUCT) + ("bench",)
LIBRARIES = tuple(f"{ROOT}.{p}" for p in ("router", "prefix_store", "transfer", "kernels", "observability"))



def _room(module: str) -> str:
    """The package a module lives in: ``pdcluster.services`` for ``pdcluster.services.x.y``, ``bench`` for bench's."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == ROOT else parts[0]


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, top_level_only: bool) -> set[str]:
    """The project modules ``module`` imports (``from a import b`` counts a.b when it is a module)."""
    tree = ast.parse(MODULES[module].read_text())
    nodes: list[ast.AST] = []
    if top_level_only:
        pending = list(tree.body)
        while pending:
            node = pending.pop()
            if isinstance(node, ast.If) and not _is_type_checking(node):
                pending.extend(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                pending.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
            else:
                nodes.append(node)
    else:
        nodes = list(ast.walk(tree))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in MODULES and n != module)
    return out


def test_libraries_never_import_services():
    offenders = sorted(f"{m} imports {dep}" for m in MODULES if _room(m) in LIBRARIES
                       for dep in _imports(m, top_level_only=False) if _room(dep) == f"{ROOT}.services")
    assert not offenders, "\n".join(offenders)


def test_nothing_in_pdcluster_imports_bench():
    offenders = sorted(f"{m} imports {dep}" for m in MODULES if m.split(".")[0] == ROOT
                       for dep in _imports(m, top_level_only=False) if _room(dep) == "bench")
    assert not offenders, "load bench through pdcluster.services.cli.checkout.bench_module:\n" + "\n".join(offenders)


# Modules under pdcluster/ that import by name: the door to bench, the CLI's main (the one subcommand a
# command line names, so that `pdcluster --help` imports none; bench's through the door) and the kernels'
# dispatch (its own triton_* modules).
IMPORTS_BY_NAME = {f"{ROOT}.services.cli.checkout", f"{ROOT}.services.cli.main", f"{ROOT}.kernels.ops"}


def _imports_by_name(module: str) -> bool:
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__", "run_module", "run_path"):
                return True
    return False


def test_bench_has_one_door():
    """A string naming a bench module is harmless; importing by name is not, outside the door."""
    offenders = sorted(m for m in MODULES if m.split(".")[0] == ROOT and m not in IMPORTS_BY_NAME
                       and _imports_by_name(m))
    assert not offenders, "import by name only in " + ", ".join(sorted(IMPORTS_BY_NAME)) + ":\n" + "\n".join(offenders)


def test_planning_imports_neither_services_nor_bench():
    offenders = sorted(f"{m} imports {dep}" for m in MODULES if _room(m) == f"{ROOT}.planning"
                       for dep in _imports(m, top_level_only=False) if _room(dep) in (f"{ROOT}.services", "bench"))
    assert not offenders, "planning is pure: pass values in, or move pure types here:\n" + "\n".join(offenders)


# The gateway's rooms: they reach the engine only through Serve and the contract at services/ root
# (messages, sampling_params, engine_errors, guided_spec, token_logprob, tokenizer, default_model).
GATEWAY_ROOMS = (f"{ROOT}.services.gateway", f"{ROOT}.services.openai")


def test_the_gateway_never_imports_the_engine():
    """Issue 39: the types both sides share live at services/ root, so the gateway's process loads no
    engine module (not even lazily; a type-only import is no load)."""
    offenders = sorted(f"{m} imports {dep}" for m in MODULES if m.startswith(GATEWAY_ROOMS)
                       for dep in _imports(m, top_level_only=False)
                       if dep == f"{ROOT}.services.engine" or dep.startswith(f"{ROOT}.services.engine."))
    assert not offenders, "move what both sides share to services/ root:\n" + "\n".join(offenders)


def _package(module: str) -> str:
    """The package whose imports are weighed: ``pdcluster.services.<room>`` in the serving layer (its
    rooms are packages of their own: autoscale, cli, gateway, ...), ``pdcluster.<x>`` elsewhere, ``bench``."""
    parts = module.split(".")
    if parts[0] != ROOT:
        return parts[0]
    return ".".join(parts[:3] if len(parts) > 2 and parts[1] == "services" else parts[:2])


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        deps = graph.setdefault(_package(m), set())
        deps.update(p for p in map(_package, _imports(m, top_level_only=False)) if p != _package(m))
    return graph


# Package circles there are, to untangle: the engine's loader reads model_meta, which reads the converted
# model's config through model_cache, which converts with the engine's model code; the tokenizer (the
# engine's and the gateway's, at services/ root since issue 39) loads its files from the model cache.
KNOWN_PACKAGE_CIRCLES = [[f"{ROOT}.services.engine", f"{ROOT}.services.model_cache", f"{ROOT}.services.model_meta",
                          f"{ROOT}.services.tokenizer"]]


def test_no_package_circles():
    """bench -> services, never back; the CLI starts the autoscaler, which never reaches into the CLI."""
    circles = _cycles(_package_graph())
    assert [c for c in circles if c not in KNOWN_PACKAGE_CIRCLES] == [], circles


def test_issue_39_pairs_are_apart():
    graph = _package_graph()
    for a, b in (("bench", f"{ROOT}.services.cli"), ("bench", f"{ROOT}.services.gateway"),
                 (f"{ROOT}.services.autoscale", f"{ROOT}.services.cli"), (f"{ROOT}.planning", f"{ROOT}.services.gateway")):
        together = [c for c in _cycles(graph) if a in c and b in c]
        assert not together, together


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """Lazy imports (inside functions) count too: a circle broken only by
    deferring one import is still a circle in the design."""
    graph = {m: _imports(m, top_level_only=False) for m in MODULES}
    # A package's __init__ importing its own submodules is how packages re-export; not a circle.
    for m, deps in graph.items():
        if MODULES[m].name == "__init__.py":
            graph[m] = {d for d in deps if not d.startswith(m + ".")}
    assert not _cycles(graph), _cycles(graph)


# The doors into pdcluster/kernels/ from outside it.  pdcluster.kernels.ops dispatches every op
# (Triton, native CPU, torch reference) and is the only way to run one.
# pdcluster.kernels.kv_quant is open too, for the KV pool's format only: the pool dtype
# for a config value, its label, the row width.  Those names compute nothing
# on tensors; they are facts about the pool's bytes that the config, the KV
# cache and the worker's status must agree on with the kernels, so they are
# defined once, beside the kernels that read the rows.  kv_quant's
# quantize/dequantize references are kernels and stay behind ops.
KV_FORMAT_NAMES = {"pool_dtype", "kv_dtype_label", "row_width", "pool_head_dim", "is_quantized", "SCALE_BYTES",
                   "KV_CACHE_DTYPES", "QUANTIZED_DTYPES"}
# A kernel benchmark times each op against its torch reference, which lives beside the kernel
# (weight_quant's --kernels table times every native build's int8 and bf16 linears).
MAY_REACH_INTO_KERNELS = {"bench.micro.kernel_speed", "bench.micro.weight_quant"}


def _kernel_imports(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """(kernels module, names taken from it; () for the module itself), lazy imports included."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, ()) for a in node.names if _room(a.name) == f"{ROOT}.kernels"]
        elif isinstance(node, ast.ImportFrom) and not node.level and _room(node.module or "") == f"{ROOT}.kernels":
            if node.module == f"{ROOT}.kernels":
                found += [(f"{ROOT}.kernels.{a.name}", ()) for a in node.names]
            else:
                found.append((node.module, tuple(a.name for a in node.names)))
    return found


def _allowed_kernel_import(target: str, names: tuple[str, ...]) -> bool:
    return target == "pdcluster.kernels.ops" or (target == "pdcluster.kernels.kv_quant" and bool(names) and set(names) <= KV_FORMAT_NAMES)


def test_kernels_are_reached_only_through_ops():
    offenders = sorted(f"{m} imports {target}" + (f" ({', '.join(names)})" if names else "")
                       for m in MODULES if _room(m) != f"{ROOT}.kernels" and m not in MAY_REACH_INTO_KERNELS
                       for target, names in _kernel_imports(m) if not _allowed_kernel_import(target, names))
    assert not offenders, "go through pdcluster.kernels.ops (add the entry it lacks there):\n" + "\n".join(offenders)


def test_kernel_import_rule_tells_ops_from_the_rest():
    assert _allowed_kernel_import("pdcluster.kernels.ops", ())
    assert _allowed_kernel_import("pdcluster.kernels.kv_quant", ("pool_dtype", "row_width"))
    assert not _allowed_kernel_import("pdcluster.kernels.kv_quant", ("quantize_rows",))
    assert not _allowed_kernel_import("pdcluster.kernels.kv_quant", ())
    assert not _allowed_kernel_import("pdcluster.kernels.cpu_native", ())


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@functools.cache
def _reserved_names() -> set[str]:
    from importlib.metadata import packages_distributions

    return set(sys.stdlib_module_names) | {ROOT, "bench", *PRODUCT} | set(packages_distributions())


@pytest.mark.parametrize("path", sorted((REPO / "bench").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_bench_module_shadows_a_package(path: Path):
    if path.stem == "__init__":
        return
    assert path.stem not in _reserved_names(), (
        f"{path.relative_to(REPO)}: `python {path.relative_to(REPO)}` would put its folder first on sys.path "
        f"and shadow the module `{path.stem}`; rename it")
