"""The module graph is a stack: no module of pflax imports from a floor above its own.

Floors, lowest first (`pflax/_src/<folder>`): core and data (independent of each
other) -> aggregators -> training -> methods -> simulation -> flower -> cli, then
the public modules `pflax/*.py`. Inside core the files are floors too. Inside a
floor the files import each other without a cycle, and no module of pflax reads a
private name (`_name`) of another: a private module of its own package
(`data/_validation.py`) is the one exception.
"""

import ast
import pathlib

import pytest

PFLAX = pathlib.Path(__file__).resolve().parents[1] / "pflax"
SRC = PFLAX / "_src"

FLOORS = {"core": 0, "data": 0, "aggregators": 1, "training": 2, "methods": 3,
          "simulation": 4, "flower": 5, "cli": 6}
"""Each folder of `pflax/_src` and its floor."""

CORE_FLOORS = {"types": 0, "prng": 0, "checks": 1, "numerics": 2, "tree": 3,
               "weights": 4}
"""The files of `pflax/_src/core`, lowest first."""


def _modules() -> list[pathlib.Path]:
  return sorted(p for p in SRC.rglob("*.py") if p.parent != SRC)


def _imported(path: pathlib.Path) -> set[tuple[str, ...]]:
  """The `pflax._src` modules a file imports (anywhere in it, lazily too), as the
  parts after `pflax._src`: `("core", "tree")`; a folder alone for `from
  pflax._src.core import tree`-style imports gives the folder and the name."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      parts = node.module.split(".")
      if parts[:2] != ["pflax", "_src"]:
        continue
      rest = tuple(parts[2:])
      if not rest:
        found.update((alias.name,) for alias in node.names)
      elif len(rest) == 1:
        found.update(rest + (alias.name,) for alias in node.names)
      else:
        found.add(rest)
    elif isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        if parts[:2] == ["pflax", "_src"] and len(parts) > 2:
          found.add(tuple(parts[2:]))
  return found


def test_every_module_is_on_a_floor():
  assert {p.relative_to(SRC).parts[0] for p in _modules()} <= set(FLOORS)
  assert not [p.name for p in SRC.glob("*.py") if p.name != "__init__.py"], (
      "pflax/_src has no flat modules: each file is in its floor's folder")
  assert {p.stem for p in (SRC / "core").glob("*.py")} - {"__init__"} == set(CORE_FLOORS)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_import_goes_up(path):
  folder = path.relative_to(SRC).parts[0]
  for target in _imported(path):
    assert FLOORS[target[0]] <= FLOORS[folder], (
        f"{path.relative_to(SRC)} imports pflax._src.{'.'.join(target)}, a floor above")
    if folder == target[0] == "core" and len(target) > 1:
      assert CORE_FLOORS[target[1]] < CORE_FLOORS[path.stem], (
          f"core/{path.name} imports core/{target[1]}.py, which is not below it")


def _module_graph() -> dict[tuple[str, ...], set[tuple[str, ...]]]:
  """Each `pflax._src` module (as `("simulation", "plots")`) and the modules it
  imports; a name imported from a module (not a module itself) counts as that
  module."""
  nodes = {p.relative_to(SRC).with_suffix("").parts for p in _modules()}
  resolve = lambda t: t if t in nodes else t[:-1]
  return {p.relative_to(SRC).with_suffix("").parts:
          {resolve(t) for t in _imported(p)} & nodes for p in _modules()}


def test_no_import_cycle():
  graph = _module_graph()
  done, path = set(), []

  def visit(node):
    if node in path:
      cycle = path[path.index(node):] + [node]
      raise AssertionError("import cycle: " + " -> ".join(".".join(m) for m in cycle))
    if node in done:
      return
    path.append(node)
    for target in sorted(graph[node]):
      visit(target)
    path.pop()
    done.add(node)

  for node in sorted(graph):
    visit(node)


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


@pytest.mark.parametrize("path", sorted(PFLAX.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PFLAX)))
def test_no_private_name_of_another_module(path):
  """No `from pflax.x import _y` (but a private module of the importer's own
  package) and no `module._y` on an imported pflax module."""
  tree = ast.parse(path.read_text())
  modules, found = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pflax"):
      package = PFLAX.parent.joinpath(*node.module.split("."))
      for alias in node.names:
        own_module = (package == path.parent
                      and (package / f"{alias.name}.py").exists())
        if _private(alias.name) and not own_module:
          found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        modules.add(alias.asname or alias.name)
    elif isinstance(node, ast.Import):
      modules.update(a.asname or a.name.split(".")[0] for a in node.names
                     if a.name.startswith("pflax"))
  found += [f"line {node.lineno}: {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in modules and _private(node.attr)]
  assert not found, f"{path.relative_to(PFLAX)} reads private names: {found}"
