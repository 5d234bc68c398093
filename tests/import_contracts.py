"""An import-linter contract type that the built-in ones cannot express: which modules may import a *submodule* of
an external package (``torch.distributed.tensor``, ``torch.distributed.checkpoint``, ...).

import-linter's graph keeps each external package as one squashed node (``torch``), so its ``forbidden`` contract
refuses ``torch.distributed.checkpoint`` as a forbidden module. The graph does keep every import's line, though;
this contract reads the imported names from those lines. Registered in ``pyproject.toml`` under
``[tool.importlinter] contract_types`` (``lint-imports`` puts its working directory on ``sys.path``, so run it from
the repository root, as ``tests/unit/test_layers.py`` does).

Contract options:

- ``importers``: package prefixes whose modules are checked (``liferaft``).
- ``allowed_importers``: package prefixes (within ``importers``) that may import the forbidden modules.
- ``forbidden_modules``: dotted names of external (sub)modules; a module is forbidden with all its descendants.
- ``ignore_imports``: ``importer -> forbidden`` pairs to let through (each one a known violation to remove).

Imports inside functions and under ``TYPE_CHECKING`` count like any other (the graph holds them all).
"""

from __future__ import annotations

import ast
import re
from typing import Any

import grimp
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def imported_names(line: str) -> list[str]:
    """Every dotted module name an import line may bring in: ``import a.b as c`` → ``a.b``;
    ``from a.b import c, d`` → ``a.b``, ``a.b.c``, ``a.b.d`` (``c`` may be a submodule or a name; both are
    checked, so ``from torch.distributed import checkpoint`` is caught). A line that does not parse alone (the
    first line of a parenthesised import) gives its module only."""
    try:
        tree = ast.parse(line.strip())
    except SyntaxError:
        m = re.match(r"\s*(?:from|import)\s+([\w.]+)", line)
        return [m.group(1)] if m and not m.group(1).startswith(".") else []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


class ForbiddenSubmodulesContract(Contract):
    """Only ``allowed_importers`` import any of ``forbidden_modules`` (external submodules, with descendants)."""

    type_name = "forbidden_submodules"

    importers = fields.ListField(subfield=fields.StringField())
    allowed_importers = fields.ListField(subfield=fields.StringField(), required=False)
    forbidden_modules = fields.ListField(subfield=fields.StringField())
    ignore_imports = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        importers: list[str] = list(self.importers)  # type: ignore[arg-type]
        allowed: list[str] = list(self.allowed_importers or [])  # type: ignore[arg-type]
        forbidden: list[str] = list(self.forbidden_modules)  # type: ignore[arg-type]
        ignored = {tuple(part.strip() for part in pair.split("->")) for pair in (self.ignore_imports or [])}
        tops = {name.split(".")[0] for name in forbidden}
        violations: list[dict[str, Any]] = []
        matched: set[tuple[str, ...]] = set()
        for module in sorted(graph.modules):
            if not any(_within(module, p) for p in importers) or any(_within(module, p) for p in allowed):
                continue
            for top in sorted(tops & graph.find_modules_directly_imported_by(module)):
                for detail in graph.get_import_details(importer=module, imported=top):
                    for name in imported_names(detail["line_contents"]):
                        hit = next((f for f in forbidden if _within(name, f)), None)
                        if hit is None:
                            continue
                        if (module, hit) in ignored:
                            matched.add((module, hit))
                            continue
                        violations.append({"importer": module, "imported": name, "forbidden": hit,
                                           "line_number": detail["line_number"]})
                        break
        warnings = [f"No matches for ignored import {' -> '.join(pair)}." for pair in sorted(ignored - matched)]
        return ContractCheck(kept=not violations, warnings=warnings, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for v in check.metadata["violations"]:
            output.print_error(f"{v['importer']} is not allowed to import {v['forbidden']}:", bold=True)
            output.print_error(f"-   {v['importer']} -> {v['imported']} (l.{v['line_number']})", bold=False)
            output.new_line()
