"""The README's Python snippets run as written, in order, in one namespace."""

import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_readme_python_snippets_run(monkeypatch):
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  assert len(blocks) >= 4
  notebooks = os.path.join(REPO, "notebooks")
  monkeypatch.chdir(notebooks)          # the custom-algorithm snippet runs from there
  monkeypatch.syspath_prepend(notebooks)
  namespace = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert "runs" in namespace and "personalized" in namespace
  del sys.modules["my_algorithms"]
