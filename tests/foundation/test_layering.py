"""The package's layering, drawn from its imports (docs/architecture.md): no two packages import each other,
directly or round a longer loop, and the pure or bottom packages import nothing above them. Imports inside
functions count: they are how a lower package would reach back up."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "m2po_megatron"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Fully qualified m2po_megatron modules imported anywhere in the file (relative imports resolved)."""
    mod = _module_name(path)
    here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from m2po_megatron import contracts`
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "m2po_megatron" or m.startswith("m2po_megatron.")}


def _unit(mod: str) -> str:
    """A module's layering unit: its sub-package (m2po_megatron.rollout.client -> rollout), or the module
    itself for the package root's modules (train, cli)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def package_graph() -> dict[str, dict[str, set[str]]]:
    """unit -> {imported unit -> the importing modules}."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in PKG.rglob("*.py"):
        src_mod = _module_name(path)
        src = _unit(src_mod)
        for target in _imported(path):
            dst = _unit(target)
            if dst != src and dst != "(root)":
                graph.setdefault(src, {}).setdefault(dst, set()).add(src_mod)
    return graph


def _cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, {})):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if not state.get(v) and (found := visit(v)):
                return found
        state[u] = 2
        stack.pop()
        return None

    for u in sorted(graph):
        if not state.get(u) and (found := visit(u)):
            return found
    return None


def test_the_graph_is_read_from_the_real_imports():
    g = package_graph()
    # known edges, so that a parser that finds nothing cannot make the tests below pass
    assert "m2po_megatron.run.trainers" in g["run"]["actor"]
    assert "m2po_megatron.rollout.generators" in g["rollout"]["staleness"]
    assert "m2po_megatron.eval.benchmarks" in g["eval"]["data"]  # a relative import, resolved
    assert "m2po_megatron.rollout.protocol" in g["rollout"]["contracts"]  # from the package, a module


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b": {"a.x"}}, "b": {"c": {"b.y"}}, "c": {"a": {"c.z"}}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": {"a.x"}}, "b": {}}) is None


def test_no_package_imports_round_a_loop():
    g = package_graph()
    loop = _cycle(g)
    if loop:
        hops = [f"{a} -> {b} ({', '.join(sorted(g[a][b]))})" for a, b in zip(loop, loop[1:])]
        pytest.fail("packages import each other in a loop: " + "; ".join(hops))


# What each package may import, layer by layer from the bottom (docs/architecture.md, "Layers"). A package
# imports only packages of lower layers; the entry points (train.py, cli.py, commands/) import anything.
ALLOWED = {
    "algo": set(), "infra": set(), "data": set(), "staleness": set(), "contracts": set(),
    "reward": {"infra", "sandbox"},  # plug-in resolution (infra/plugins.py); the code reward's sandbox
    "sandbox": set(),
    "models": {"infra"},
    "agents": {"infra", "models"},  # rollout plug-ins; m2po_megatron.api (a root module) re-exports their public names
    "examples": {"api"},  # example plug-ins, written only with m2po_megatron.api as users' are
    "actor": {"algo", "infra", "models"},
    "eval": {"agents", "data", "reward"},
    "convert": {"actor", "infra", "models"},
    "rollout": {"actor", "agents", "algo", "contracts", "data", "infra", "models", "reward", "staleness"},
    "demo": {"api", "eval", "examples", "reward"},  # the agent task's warm-up is measured with its rollout function
    "config": {"actor", "agents", "algo", "data", "models", "reward", "rollout"},
    "run": {"actor", "config", "convert", "data", "eval", "infra", "rollout"},
    "sweep": {"config", "infra", "models", "run"},
    "plan": {"config", "infra", "models", "rollout", "run", "staleness"},
    "rehearse": {"actor", "config", "infra", "models"},
    "preflight": {"actor", "config", "infra", "models", "plan", "rollout", "run"},
}
ENTRY_POINTS = {"(root)", "commands"}


def test_every_package_has_its_place():
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert packages - ENTRY_POINTS == set(ALLOWED), "place a new package in ALLOWED and docs/architecture.md"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_the_layers_below_them(package):
    g = package_graph()
    above = {dst: sorted(mods) for dst, mods in g.get(package, {}).items() if dst not in ALLOWED[package]}
    assert not above, f"{package} imports {above}; allowed: {sorted(ALLOWED[package])}"
