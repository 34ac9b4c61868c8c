"""The README and the Markdown pages of docs/ stay true to the code and to each other.

The README's table of modules ("What is inside") names exactly the public modules
`pflax/*.py`, and only names in their `__all__`; every relative link of the README
and of `docs/*.md` reaches an existing file (and heading, for a Markdown file); the
README links every page of docs/; docs/main-job.md names every flag of `pflax-run`.
The Python blocks are run by tests/test_readme.py (slow).
"""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
  """The text without fenced code blocks and inline code spans."""
  return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _anchors(text: str) -> set[str]:
  """GitHub's anchors of a Markdown file's headings: lower case, punctuation but
  `-` and `_` dropped, spaces as `-`, repeats numbered `-1`, `-2`, ..."""
  anchors, seen = set(), {}
  for heading in _HEADING.findall(_FENCE.sub("", text)):
    slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


def _public_modules() -> list[str]:
  return sorted(p.stem for p in (ROOT / "pflax").glob("*.py") if not p.stem.startswith("_"))


def _names_table() -> dict[str, str]:
  """`{module: its row's description}` of the README's "What is inside" table."""
  section = README.read_text().split("## What is inside", 1)[1].split("\n## ", 1)[0]
  rows = re.findall(r"^\| `pflax\.(\w+)` \|(.*)\|\s*$", section, re.M)
  return dict(rows)


def test_the_readme_starts_with_the_main_job_and_the_tests():
  first = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).splitlines()
  assert first[0].startswith("pip install . && pflax-run  ")
  assert first[1].startswith("pip install -e '.[test]' && python -m pytest -n 2 --dist loadfile")


def test_the_readme_table_lists_exactly_the_public_modules():
  table = _names_table()
  assert sorted(table) == _public_modules()
  assert len(table) == len(re.findall(r"^\| `pflax\.", README.read_text().split(
      "## What is inside", 1)[1].split("\n## ", 1)[0], re.M)), "a module has two rows"
  index = (DOCS / "index.rst").read_text()
  assert sorted(re.findall(r"^\s+api/(\w+)$", index, re.M)) == _public_modules()


@pytest.mark.parametrize("name", _public_modules())
def test_each_row_names_only_names_of_its_modules_all(name):
  if name == "flower":
    pytest.importorskip("flwr")
  exported = set(importlib.import_module(f"pflax.{name}").__all__)
  cited = [n for n in re.findall(r"`([^`]+)`", _names_table()[name])
           if re.fullmatch(r"[A-Za-z_]\w*", n)]
  assert cited, f"the README's row of pflax.{name} names none of its names"
  assert not set(cited) - exported, (
      f"the README's row of pflax.{name} names what is not in its __all__")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page):
  broken = []
  for target in _LINK.findall(_prose(page.read_text())):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):          # https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    if not linked.exists():
      broken.append(target)
    elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
      broken.append(target)
  assert not broken, f"{page.relative_to(ROOT)} links nothing at {broken}"


def test_the_readme_links_every_docs_page():
  linked = {(README.parent / t.partition("#")[0]).resolve()
            for t in _LINK.findall(_prose(README.read_text()))}
  missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
  assert not missing


def test_main_job_names_every_flag_of_pflax_run():
  from pflax._src.cli import parser  # pylint: disable=import-outside-toplevel
  page = (DOCS / "main-job.md").read_text()
  flags = {f for action in parser.parser()._actions  # pylint: disable=protected-access
           for f in action.option_strings if f.startswith("--") and f != "--help"}
  missing = sorted(f for f in flags if not re.search(rf"{re.escape(f)}(?![\w-])", page))
  assert not missing
