"""The docs name what exists: every file path and ``pagedkv.x`` name in README.md,
docs/architecture.md, docs/simt.md, docs/mla.md, docs/quantized_kv.md and csrc/simt/README.md
resolves, every Python module of the package is listed in the architecture's Python package
section, and every file of the emulator, its backend and its self-tests in docs/simt.md."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "pagedkv"
DOCS = ["README.md", "docs/architecture.md", "docs/simt.md", "docs/mla.md", "docs/quantized_kv.md",
        "csrc/simt/README.md"]
# Folders whose every file docs/simt.md names by its path.
SIMT_FOLDERS = ["csrc/simt", "csrc/simt_backend", "tests/simt"]

# A path under one of the repository's top-level folders (pagedkv/... is python/pagedkv/...).
PATH = re.compile(r"(?<![\w./-])((?:csrc|python|pagedkv|tests|bench|docs|scripts)/[\w./*-]*)")
# A dotted name below pagedkv: a module, or an attribute of one (pagedkv.ops.reference,
# pagedkv.PagedKVError); not torch.ops.pagedkv.<op>.
DOTTED = re.compile(r"(?<![\w.])pagedkv(?:\.\w+)+")
# Outputs named by the docs that a run writes, not files of the repository.
OUTPUTS = {"bench/results/*.json"}
# The API reference (`make docs`): a page per layer, pagedkv.rst for what pagedkv exports.
API = ROOT / "docs" / "api"
AUTOMODULE = re.compile(r"^\.\. automodule:: ([\w.]+)", re.M)
AUTO_OBJECT = re.compile(r"^\.\. auto(?:function|class|exception|data):: (\w+)", re.M)


def paths_in(text: str) -> list[str]:
    return sorted({m.rstrip(".,:;") for m in PATH.findall(text)})


def resolve(path: str) -> list[Path]:
    """The files or folders a named path (a glob allowed) stands for."""
    if path.startswith("pagedkv/"):
        path = "python/" + path
    return list(ROOT.glob(path)) if "*" in path else [p for p in [ROOT / path] if p.exists()]


def resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute of the longest importable prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS)
def test_named_paths_exist(doc):
    text = (ROOT / doc).read_text()
    named = paths_in(text)
    assert len(named) >= 5, f"{doc}: expected to find file paths, found {named}"
    missing = [p for p in named if p not in OUTPUTS and not resolve(p)]
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_named_modules_resolve(doc):
    text = (ROOT / doc).read_text()
    unknown = [name for name in sorted(set(DOTTED.findall(text))) if not resolves(name)]
    assert not unknown, f"{doc} names pagedkv modules or attributes that do not exist: {unknown}"


def package_section() -> str:
    text = (ROOT / "docs/architecture.md").read_text()
    match = re.search(r"^## Python package\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "docs/architecture.md has no '## Python package' section"
    return match.group(1)


def listed_modules(section: str) -> set[str]:
    """Module paths relative to python/pagedkv listed in the section: the first word of the
    code block's rows (ops/reference.py, pagedkv/errors.py) and `pagedkv/...py` in the prose;
    a package's __init__.py also counts as listed through its layer's header (pagedkv.ops)."""
    listed = set()
    for line in section.splitlines():
        word = line.split(maxsplit=1)[0] if line.strip() else ""
        if word.endswith(".py"):
            listed.add(word.removeprefix("pagedkv/"))
    listed |= {m.removeprefix("pagedkv/") for m in re.findall(r"pagedkv/[\w/]+\.py", section)}
    for package in re.findall(r"^layer \d+\s+pagedkv\.(\w+)", section, re.M):
        listed.add(f"{package}/__init__.py")
    return listed


def test_every_module_is_listed_in_the_architecture():
    listed = listed_modules(package_section())
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert len(modules) >= 20 and {"ops/reference.py", "__init__.py"} <= modules
    assert not modules - listed, (
        f"modules missing from docs/architecture.md's Python package section: "
        f"{sorted(modules - listed)}"
    )
    assert not listed - modules, f"listed modules that do not exist: {sorted(listed - modules)}"


def test_simt_doc_names_every_file_of_the_emulator():
    named = set(paths_in((ROOT / "docs/simt.md").read_text()))
    files = {str(p.relative_to(ROOT)) for d in SIMT_FOLDERS for p in (ROOT / d).iterdir()
             if p.is_file() and p.suffix in {".h", ".cpp", ".py", ".md"}}
    assert len(files) >= 20 and "csrc/simt/fiber.cpp" in files
    assert not files - named, f"docs/simt.md does not name {sorted(files - named)}"


def test_the_api_reference_has_every_export_and_package():
    """Every name pagedkv exports has its entry on the pagedkv page (each subpackage's page
    documents its modules' __all__ through automodule), and every subpackage has a page."""
    import pagedkv

    named = set(AUTO_OBJECT.findall((API / "pagedkv.rst").read_text()))
    exported = {n for n in pagedkv.__all__ if not isinstance(getattr(pagedkv, n), types.ModuleType)}
    assert len(exported) >= 20
    assert named == exported, (
        f"missing: {sorted(exported - named)}, not exported: {sorted(named - exported)}")
    modules = {m for page in API.glob("*.rst") for m in AUTOMODULE.findall(page.read_text())}
    packages = {"pagedkv." + str(p.parent.relative_to(PACKAGE)).replace("/", ".")
                for p in PACKAGE.glob("*/__init__.py")}
    assert len(packages) >= 5 and not packages - modules, (
        f"subpackages without an API page: {sorted(packages - modules)}")


def test_the_checks_catch_what_they_should():
    """The helpers find a missing path and an unlisted module (so the tests above can fail)."""
    assert paths_in("see `csrc/nope.h`, pagedkv/ops/nope.py.") == [
        "csrc/nope.h", "pagedkv/ops/nope.py"]
    assert not resolve("csrc/nope.h") and resolve("pagedkv/ops/reference.py")
    assert resolves("pagedkv.ops.reference") and not resolves("pagedkv.ops.nope")
    section = "```\nlayer 1  pagedkv.ops\nops/reference.py   the oracle\n```\n"
    assert listed_modules(section) == {"ops/reference.py", "ops/__init__.py"}
