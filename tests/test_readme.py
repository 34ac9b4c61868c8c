"""The README's Python snippets run as written, in order, in one namespace; so do
those of the docs pages that took the README's longer sections."""

import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOC_PAGES = ("docs/scaling.md",
             pytest.param("docs/flower.md", marks=pytest.mark.extended))
"""Pages whose Python blocks run as written (each page in a namespace of its own).
The Flower page's deployment is `extended` (run by hand): CI's slow pass runs the
same deployment in tests/test_flower_federation.py."""


def _python_blocks(path: str) -> list[str]:
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.slow
def test_readme_python_snippets_run(monkeypatch):
  blocks = _python_blocks("README.md")
  assert len(blocks) >= 4
  notebooks = os.path.join(REPO, "notebooks")
  monkeypatch.chdir(notebooks)          # the custom-algorithm snippet runs from there
  monkeypatch.syspath_prepend(notebooks)
  namespace = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert "runs" in namespace and "personalized" in namespace
  del sys.modules["my_algorithms"]


@pytest.mark.slow
@pytest.mark.parametrize("page", DOC_PAGES)
def test_docs_python_snippets_run(page, monkeypatch, tmp_path):
  if page == "docs/flower.md":
    pytest.importorskip("flwr")
  blocks = _python_blocks(page)
  assert blocks
  monkeypatch.chdir(tmp_path)           # what a snippet writes (runs/...) stays there
  namespace = {}
  for block in blocks:
    exec(compile(block, page, "exec"), namespace)  # pylint: disable=exec-used
