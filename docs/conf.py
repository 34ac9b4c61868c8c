"""Sphinx configuration of pflax's API reference (built from the docstrings).

Build: `pip install -e '.[docs]' && sphinx-build -W -b html docs docs/_build`.
"""

import pflax

project = "pflax"
author = "pflax developers"
release = pflax.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
# The guides are Markdown pages read on the repository; the reference is the API.
exclude_patterns = ["_build", "*.md"]
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
html_theme = "alabaster"
