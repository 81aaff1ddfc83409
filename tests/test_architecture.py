"""The layers as the folders draw them (docs/architecture.md), checked on the imports.

Arrows point down only: front-ends (``rtts.api``) -> the core (``rtts.core``) -> engines
(``rtts.engines``); ``rtts.text`` and ``rtts.audio`` are leaves under all of them. No
front-end imports another front-end, the scheduler or an engine; nothing outside
``rtts.engines`` probes an engine with ``getattr`` (the contract is ``EngineInfo``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "rtts"

# rtts.api modules every front-end may use; the HTTP router and the composition root
# (rtts.server) are the only places that know every front-end.
SHARED_API = {"rtts.api", "rtts.api.admission", "rtts.api.auth", "rtts.api.compat",
              "rtts.api.handshake", "rtts.api.listener", "rtts.api.sockets", "rtts.api.tasks",
              "rtts.api.http", "rtts.api.http.common", "rtts.api.http.speech"}
ROUTERS = {"rtts.api.http.app"}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every rtts module ``path`` imports (at any level, TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("rtts"):
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rtts"))
    return {m for m in out if _exists(m)}


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT.parent / rel).with_suffix(".py").is_file() or (
        ROOT.parent / rel / "__init__.py").is_file()


MODULES = {_module(p): p for p in sorted(ROOT.rglob("*.py"))}


def _frontend(module: str) -> str | None:
    """The front-end a module belongs to (``rtts.api.native`` for its package), if any."""
    if not module.startswith("rtts.api.") or module in SHARED_API | ROUTERS:
        return None
    parts = module.split(".")
    return ".".join(parts[:3])


def test_relative_imports_are_not_used() -> None:
    """Absolute imports only: a module's imports read the same wherever it moves."""
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        rel = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        assert not rel, (module, rel)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _frontend(m)))
def test_a_front_end_imports_no_other_front_end_nor_engine_nor_scheduler(module: str) -> None:
    mine = _frontend(module)
    for dep in _imports(MODULES[module]):
        other = _frontend(dep)
        assert other is None or other == mine, f"{module} imports front-end {dep}"
        assert not dep.startswith("rtts.engines"), f"{module} reaches into engine {dep}"
        assert dep != "rtts.core.scheduler", f"{module} reaches into the scheduler"


@pytest.mark.parametrize("layer,forbidden", [
    ("rtts.engines", ("rtts.api", "rtts.server", "rtts.core.service", "rtts.core.context",
                      "rtts.core.scheduler")),
    ("rtts.core", ("rtts.api", "rtts.server", "rtts.cli", "rtts.bench")),
    ("rtts.text", ("rtts.api", "rtts.core", "rtts.engines", "rtts.server")),
    ("rtts.audio", ("rtts.api", "rtts.core", "rtts.engines", "rtts.server")),
])
def test_arrows_point_down(layer: str, forbidden: tuple[str, ...]) -> None:
    for module, path in MODULES.items():
        if module != layer and not module.startswith(layer + "."):
            continue
        for dep in _imports(path):
            assert not dep.startswith(forbidden), f"{module} imports {dep}"


def test_nothing_probes_an_engine_with_getattr() -> None:
    pattern = re.compile(r"getattr\(.*engine")
    hits = [f"{m}:{i}" for m, p in MODULES.items()
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits


def test_every_module_is_named_in_the_architecture_document() -> None:
    doc = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [str(p.relative_to(ROOT.parent)) for p in sorted(ROOT.rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py")
               and f"`{p.relative_to(ROOT.parent)}`" not in doc]
    assert not missing, f"docs/architecture.md does not name {missing}"
