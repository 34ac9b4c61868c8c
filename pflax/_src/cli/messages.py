"""`pflax-run`'s errors and warnings: one line each, settings named as flags."""

import os
import sys
from collections.abc import Callable

from pflax._src.cli import parser

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))) + os.sep
"""Warnings issued from files under this directory are pflax's own."""


def fail(message: str) -> SystemExit:
  """The exit of `pflax-run` with `message` (raise it)."""
  return SystemExit(f"pflax-run: {message}")


def flag_message(error: Exception | Warning | str) -> str:
  """A configuration error (or warning) with its leading field named as the
  command-line flag: `clients must ...`, `clients: ...` -> `--clients ...`."""
  text = str(error)
  for field in parser.CONFIG_FIELDS:
    if text.startswith((field + " ", field + ":")):
      return parser.flag(field) + text[len(field):]
  return text


def one_line_warnings(show: Callable[..., None]) -> Callable[..., None]:
  """A `warnings.showwarning` that prints pflax's warnings as one line
  `pflax-run: warning: ...` on stderr (fields named as flags), others as `show`."""
  def showwarning(message, category, filename, lineno, file=None, line=None):
    if os.path.abspath(filename).startswith(_PACKAGE_DIR):
      print(f"pflax-run: warning: {flag_message(message)}", file=sys.stderr)
    else:
      show(message, category, filename, lineno, file, line)
  return showwarning
