"""Sphinx configuration of the pagedkv documentation: the narrative pages (docs/*.md, through
MyST) and the API reference (api/*.rst) built from the docstrings (autodoc + napoleon, numpy
style). `make docs` builds it into build/docs with warnings as errors."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent / "python"))

import pagedkv  # noqa: E402

project = "pagedkv"
copyright = "the pagedkv authors"
release = version = pagedkv.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"pagedkv {release}"

napoleon_google_docstring = True  # the classes use Args: sections, the ops numpy style
napoleon_numpy_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
myst_heading_anchors = 3

# Every object is documented once: on the page of the shortest module that lists it in its
# __all__ among those the API pages document (pagedkv itself first, then the subpackages, then
# their modules). A module page skips the members that live on another page.
AUTOMODULE = re.compile(r"^\.\. automodule:: ([\w.]+)", re.M)


def documented_modules() -> list[str]:
    pages = (DOCS / "api").glob("*.rst")
    names = {m for page in pages for m in AUTOMODULE.findall(page.read_text())}
    return sorted(names | {"pagedkv"}, key=lambda m: (m.count("."), m))


def homes() -> dict[tuple[str, int], str]:
    """(name, id of the object) -> the module whose page documents it."""
    home: dict[tuple[str, int], str] = {}
    for module_name in documented_modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            home.setdefault((name, id(getattr(module, name))), module_name)
    return home


HOMES = homes()


def skip_elsewhere(app, what: str, name: str, obj, skip: bool, options) -> bool | None:
    if what != "module":
        return None
    module = app.env.temp_data.get("autodoc:module")
    home = HOMES.get((name, id(obj)))
    return True if home is not None and home != module else None


def setup(app) -> None:
    app.connect("autodoc-skip-member", skip_elsewhere)
