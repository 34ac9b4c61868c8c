"""The API reference (docs/, Sphinx autodoc) covers every public module.

Each page documents its module's `__all__` (autodoc reads it); these tests keep
the pages and the modules in step. CI builds the reference with warnings as
errors (`.ci/run`).
"""

import importlib
import pathlib
import re

import pytest

import pflax

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PUBLIC = sorted({*pflax.__all__, "flower", "privacy"})


def _pages() -> list[str]:
  index = (DOCS / "index.rst").read_text()
  return re.findall(r"^\s+api/(\w+)$", index, re.MULTILINE)


def test_the_index_lists_one_page_per_public_module():
  assert sorted(_pages()) == PUBLIC


@pytest.mark.parametrize("name", PUBLIC)
def test_each_page_documents_its_module_from_its_sorted_all(name):
  page = (DOCS / "api" / f"{name}.rst").read_text()
  assert re.search(rf"^\.\. automodule:: pflax\.{name}$", page, re.MULTILINE)
  if name == "flower":
    pytest.importorskip("flwr")
  module = importlib.import_module(f"pflax.{name}")
  exported = list(module.__all__)
  assert exported and all(hasattr(module, n) for n in exported)
  assert exported == sorted(exported)
