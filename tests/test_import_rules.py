"""The layering rules of the repository layout, checked on every import of the product code.

Read with ``ast``, so every import counts: at module level, inside functions, under
``if TYPE_CHECKING:``, relative ones, and ``importlib.import_module("literal")``.

- ``services/<role>/`` never imports ``pagoda`` (the CLI resolves model names) nor
  ``services.<other role>`` (services talk over ZeroMQ only);
- ``shared/`` imports nothing from ``services``, ``kernels`` or ``pagoda``;
- ``kernels/`` imports only the standard library, ``torch``, ``triton`` and ``kernels``;
- no import cycle among the modules of ``services/`` (e.g. ``http_api.py`` builds the
  app of ``http_app.py``, which never imports ``http_api.py`` back).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("pagoda", "shared", "services", "kernels")
KERNELS_ALLOWED = frozenset({"torch", "triton", "kernels"}) | sys.stdlib_module_names



@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name; `from a import b` gives "a.b" (b may be a module)
    lineno: int


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every import in ``source``, the file of ``module``, anywhere in its tree."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [Import(base if a.name == "*" else f"{base}.{a.name}".lstrip("."), node.lineno)
                      for a in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                   or isinstance(node.func, ast.Name) and node.func.id == "__import__")):
            found.append(Import(node.args[0].value, node.lineno))
    return found


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def product_files() -> list[Path]:
    return [p for top in PRODUCT_DIRS for p in sorted((ROOT / top).rglob("*.py"))]


def violations(select: str, rule: str, breaks) -> list[str]:  # type: ignore[no-untyped-def]
    """``file:line: imports X: rule`` for each import of the files under ``select`` for
    which ``breaks(file's module, imported module)`` holds."""
    out = []
    for path in product_files():
        mod = module_name(path)
        if not under(mod, select):
            continue
        for imp in imports_of(path.read_text(encoding="utf-8"), mod, path.name == "__init__.py"):
            if breaks(mod, imp.module):
                out.append(f"{path.relative_to(ROOT)}:{imp.lineno}: imports {imp.module}: {rule}")
    return out


def check(found: list[str]) -> None:
    if found:
        pytest.fail(f"{len(found)} import(s) break the layering rules:\n" + "\n".join(found),
                    pytrace=False)


def test_the_collector_sees_every_kind_of_import() -> None:
    source = (
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pagoda.llm import LLM\n"
        "def f():\n"
        "    import services.worker.main\n"
        "    from services import scheduler\n"
        "    from . import sibling\n"
        "    from ..scheduler.request import Request\n"
        "    importlib.import_module('kernels.prefill')\n"
    )
    got = [(i.module, i.lineno) for i in imports_of(source, "services.tokenizer.x")]
    assert got == [
        ("os", 1), ("typing.TYPE_CHECKING", 2), ("pagoda.llm.LLM", 4),
        ("services.worker.main", 6), ("services.scheduler", 7),
        ("services.tokenizer.sibling", 8), ("services.scheduler.request.Request", 9),
        ("kernels.prefill", 10),
    ]
    assert module_name(ROOT / "services" / "worker" / "__init__.py") == "services.worker"
    files = {module_name(p) for p in product_files()}
    assert {"shared.protocol", "services.worker.main", "kernels.prefill",
            "services.tokenizer.http_api", "services.tokenizer.http_app"} <= files


def test_services_import_neither_pagoda_nor_another_service() -> None:
    def breaks(mod: str, imported: str) -> bool:
        parts = mod.split(".")
        role = parts[1] if len(parts) > 2 else None  # None: services/__init__.py
        if under(imported, "pagoda"):
            return True
        if imported == "services" or not under(imported, "services"):
            return False
        return imported.split(".")[1] != role

    found = violations("services", "services/<role>/ imports neither pagoda nor another "
                       "service (models reach a service as a directory; services talk over ZMQ)",
                       breaks)
    check(found)


def test_shared_imports_no_service_kernel_or_pagoda() -> None:
    found = violations("shared", "shared/ imports nothing from services, kernels or pagoda",
                       lambda _, imported: any(under(imported, p)
                                               for p in ("services", "kernels", "pagoda")))
    check(found)


def test_kernels_import_only_stdlib_torch_triton() -> None:
    found = violations("kernels", "kernels/ imports only the standard library, torch, triton "
                       "and kernels", lambda _, imported: imported.split(".")[0] not in KERNELS_ALLOWED)
    check(found)


def test_no_import_cycle_inside_services() -> None:
    graph: dict[str, set[str]] = {}
    for path in product_files():
        mod = module_name(path)
        if not under(mod, "services"):
            continue
        imported = imports_of(path.read_text(encoding="utf-8"), mod, path.name == "__init__.py")
        graph[mod] = {i.module for i in imported if under(i.module, "services")}
    # `from a import b` names a.b, which may be a module or a name in module a
    edges = {m: {t if t in graph else t.rpartition(".")[0] for t in targets} - {m}
             for m, targets in graph.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join([*path[path.index(t):], t]))
            elif t in edges and t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles inside services/:\n" + "\n".join(cycles)
