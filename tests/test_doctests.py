"""Every docstring example of every pflax module runs (`doctest`)."""

import doctest
import importlib
import pkgutil

import pytest

import pflax

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(pflax.__path__, prefix="pflax.")
    if info.name != "pflax.__main__")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS
                           | doctest.NORMALIZE_WHITESPACE, verbose=False)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_the_examples_are_found():
  found = sum(len(doctest.DocTestFinder().find(importlib.import_module(name)))
              for name in MODULES)
  assert found > 50  # docstrings, examples included, of every module
