"""The floors of docs/architecture.md, checked: what may import what, and the operator template.

The import graph is read with `ast` from every .py file of the shipped packages, function-level
imports and `importlib.import_module("...")` / `__import__("...")` with a literal name included.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import autotune

ROOT = Path(__file__).resolve().parents[1]
GROUND = {"autotune"}
OPERATORS = {"w12", "gdn", "tree_attn", "lmhead"}
TOP = {"specpilot"}
ALLOWED_SIBLINGS = {("lmhead", "w12")}  # the LM head may reuse the W12 GEMM
# public functions that take `variant=` without `out=`: ops that update their inputs in place, and plan
# steps (they return a schedule, not a tensor)
NO_OUT = {"gdn.commit", "tree_attn.plan"}


def packages(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file() and p.name not in ("tests", "perf"))


def imports(path: Path, root: Path):
    """(line, imported module) for every import in one file, relative ones resolved."""
    package = list(path.relative_to(root).with_suffix("").parts[:-1])  # a/b/c.py and a/b/__init__.py: a.b
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            if node.module:
                yield node.lineno, ".".join(base + [node.module])
            else:  # `from . import x`: x is a module of the package
                for alias in node.names:
                    yield node.lineno, ".".join(base + [alias.name])
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"))):
            yield node.lineno, node.args[0].value


def allowed(src: str, dst: str) -> bool:
    if src == dst or dst in GROUND or src in TOP:
        return True
    if src in OPERATORS:
        return (src, dst) in ALLOWED_SIBLINGS
    return False  # the ground imports nothing of the project


def violations(root: Path) -> list[str]:
    pkgs = set(packages(root))
    found = []
    unknown = pkgs - GROUND - OPERATORS - TOP
    if unknown:
        found.append(f"packages on no floor: {sorted(unknown)} (add them to docs/architecture.md and this test)")
    for pkg in sorted(pkgs):
        for path in sorted((root / pkg).rglob("*.py")):
            for line, name in imports(path, root):
                dst = name.split(".")[0]
                if dst in pkgs and not allowed(pkg, dst):
                    found.append(f"{path.relative_to(root)}:{line}: {pkg} imports {name}")
    return found


def test_no_upward_or_sibling_imports():
    assert violations(ROOT) == []


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """A tree with one forbidden import of each kind: top-level, inside a function, relative, dynamic."""
    for pkg in ("autotune", "w12", "gdn", "lmhead", "specpilot"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "autotune" / "a.py").write_text("def f():\n    import specpilot.cli\n")
    (tmp_path / "w12" / "b.py").write_text("from gdn import ops\n")
    (tmp_path / "w12" / "sub").mkdir()
    (tmp_path / "w12" / "sub" / "c.py").write_text("from ... import specpilot\nfrom .. import ops\n")
    (tmp_path / "gdn" / "d.py").write_text("import importlib\nm = importlib.import_module('w12.ops')\n")
    (tmp_path / "lmhead" / "e.py").write_text("import w12\nimport autotune\n")
    (tmp_path / "specpilot" / "f.py").write_text("import w12, gdn, autotune\n")
    got = violations(tmp_path)
    assert got == ["autotune/a.py:2: autotune imports specpilot.cli", "gdn/d.py:2: gdn imports w12.ops",
                   "w12/b.py:1: w12 imports gdn", "w12/sub/c.py:1: w12 imports specpilot"], got


@pytest.mark.parametrize("op", sorted(OPERATORS))
def test_each_operator_imports_alone(op):
    """Importing an operator (and its ops module, where it has one) loads no other operator and no specpilot."""
    others = sorted((OPERATORS | TOP) - {op} - {b for a, b in ALLOWED_SIBLINGS if a == op})
    code = (f"import importlib, importlib.util, sys\nimport {op}\n"
            f"if importlib.util.find_spec('{op}.ops'):\n    importlib.import_module('{op}.ops')\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {others!r}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


# --------------------------------------------------------------------------- operator template


def _with_ops() -> list[str]:
    return [p for p in sorted(OPERATORS) if (ROOT / p / "ops.py").is_file()]


def test_operators_with_kernels_follow_the_template():
    assert _with_ops(), "no operator package has an ops.py"
    for op in _with_ops():
        for f in ("reference.py", "ops.py", "configs.py", "kernels/__init__.py"):
            assert (ROOT / op / f).is_file(), f"{op}/{f} is missing (docs/architecture.md: the operator template)"
        ref = ast.parse((ROOT / op / "reference.py").read_text())
        refs = [n.name for n in ref.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_reference")]
        mod = __import__(op)
        assert refs and not set(refs) - set(mod.__all__), f"{op}/__init__.py must re-export {refs}"


@pytest.mark.parametrize("op", _with_ops())
def test_ops_module_shape(op):
    """VARIANTS is an autotune.Variants, a `_plan` step exists, and every public op function takes
    keyword-only `variant=None` and `out=None` (in-place ops and plan steps: `variant=None` only). An
    operator served by a class (`lmhead.CertifiedHead`: built once, called per step) takes `variant=None`
    in its constructor, and its public methods that return one tensor take `out=None`."""
    ops = __import__(f"{op}.ops", fromlist=["_"])
    assert isinstance(ops.VARIANTS, autotune.Variants), f"{op}.ops.VARIANTS"
    assert any(n == "_plan" or n.startswith("_plan_") for n in vars(ops)), f"{op}.ops has no _plan step"
    for cls in (getattr(ops, n) for n in ops.__all__ if inspect.isclass(getattr(ops, n))):
        init = inspect.signature(cls.__init__).parameters
        if "variant" not in init:
            continue
        p = init["variant"]
        assert p.kind is p.KEYWORD_ONLY and p.default is None, f"{op}.{cls.__name__}(variant=)"
        methods = [m for n, m in vars(cls).items() if inspect.isfunction(m) and not n.startswith("_")]
        outs = [m for m in methods if "out" in inspect.signature(m).parameters]
        assert outs, f"{op}.{cls.__name__}: no public method takes out="
        for m in outs:
            p = inspect.signature(m).parameters["out"]
            assert p.kind is p.KEYWORD_ONLY and p.default is None, f"{op}.{cls.__name__}.{m.__name__}: out"
        return
    public = [getattr(ops, n) for n in ops.__all__ if inspect.isfunction(getattr(ops, n))]
    takes = [f for f in public if "variant" in inspect.signature(f).parameters]
    assert takes, f"{op}.ops has no public function with variant="
    for f in takes:
        params = inspect.signature(f).parameters
        want = ("variant",) if f"{op}.{f.__name__}" in NO_OUT else ("variant", "out")
        for name in want:
            p = params.get(name)
            assert p is not None and p.kind is p.KEYWORD_ONLY and p.default is None, f"{op}.{f.__name__}: {name}"


def test_operators_without_kernels_are_documented_packages():
    """tree_attn / lmhead before their kernels: an importable package with a docstring, nothing pretending."""
    for op in sorted(OPERATORS - set(_with_ops())):
        tree = ast.parse((ROOT / op / "__init__.py").read_text())
        assert ast.get_docstring(tree), f"{op}/__init__.py needs a docstring saying what the package will hold"


def _module_graph(root: Path, pkg: str) -> dict[str, set[str]]:
    """Module -> the modules of `pkg` it imports (a package's name stands for its __init__)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / pkg.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = {dst for _, dst in imports(path, root) if dst == pkg or dst.startswith(pkg + ".")}
    return graph


def _cycles(graph: dict[str, set[str]], mods: set[str]) -> list[str]:
    found = []

    def walk(m, path):
        for d in sorted(graph.get(m, ()) & mods):
            if d in path:
                found.append(" -> ".join(path[path.index(d):] + [d]))
            elif len(path) < len(mods):
                walk(d, path + [d])

    for m in sorted(mods):
        walk(m, [m])
    return found


def test_engine_modules_import_without_cycles():
    """Inside specpilot.engine no module imports one that imports it back (engine and batch share `records`),
    and the speculation pieces (specpilot.engine.spec) import none of the engine's modules."""
    graph = _module_graph(ROOT, "specpilot.engine")
    cycles = _cycles(graph, {m for m in graph if m != "specpilot.engine"})  # the package's __init__ re-exports
    assert not cycles, cycles[:5]
    spec = {m: {d for d in ds if not d.startswith("specpilot.engine.spec")} for m, ds in graph.items()
            if m.startswith("specpilot.engine.spec")}
    assert spec and not any(spec.values()), spec


def test_the_cycle_check_sees_a_cycle(tmp_path):
    """A function-level import back (the pattern engine and batch had) is a cycle."""
    pkg = tmp_path / "specpilot" / "engine"
    pkg.mkdir(parents=True)
    (tmp_path / "specpilot" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from .a import f\n")
    graph = _module_graph(tmp_path, "specpilot.engine")
    assert _cycles(graph, {"specpilot.engine.a", "specpilot.engine.b"})
