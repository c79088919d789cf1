"""The package's layering: a module imports only from its own layer and the layers below, and
nothing outside the package; bench/ imports the package and itself, never the tests.

0 base (errors, checks) < 1 ops < 2 cache < 3 blocks < 4 serving < 5 tools, integrations;
``pagedkv/__init__`` re-exports the public API, above every layer. Imports inside functions count
too, and so do ``importlib.import_module("name")`` and ``__import__("name")`` with a literal name.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "pagedkv"
BENCH = ROOT / "bench"
LAYERS = {"errors": 0, "checks": 0, "_C": 0, "_simt": 0, "ops": 1, "cache": 2, "blocks": 3,
          "serving": 4, "tools": 5, "integrations": 5}
MODULES = sorted(PACKAGE.rglob("*.py"))
BENCH_MODULES = sorted(BENCH.rglob("*.py"))
TESTS = {"tests", "setup", *(p.stem for p in (ROOT / "tests").rglob("*.py"))}
"""The checkout's importable names that are neither the package nor bench: the test suite's
modules (helpers, conftest, ...) and setup.py."""


def layer_of(dotted: str) -> int:
    """The layer of ``pagedkv.x...`` (by its first component below pagedkv)."""
    parts = dotted.split(".")
    assert parts[0] == "pagedkv"
    if len(parts) == 1:
        return len(LAYERS)  # the package itself: the public API, above every layer
    return LAYERS[parts[1].removesuffix(".py")]


def _module_of(path: Path, root: Path) -> tuple[str, str]:
    """(module, its package) of ``path``, a file under ``root`` (a package folder)."""
    module = ".".join([root.name, *path.relative_to(root).with_suffix("").parts])
    if path.name == "__init__.py":
        module = module.removesuffix(".__init__")
        return module, module
    return module, module.rsplit(".", 1)[0]


def _dynamic(node: ast.Call) -> str | None:
    """The literal name of ``importlib.import_module("x")`` or ``__import__("x")``."""
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("__import__", "import_module"))
    first = node.args[0] if node.args else None
    if named and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def all_imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` (a file under ``root``, a package folder),
    relative ones resolved; ``from a import b`` gives ``a.b`` when ``a`` is the root package."""
    _, package = _module_of(path, root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name == root.name:  # from pagedkv import x: the layer of x
                found += [(node.lineno, f"{name}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, name))
        elif isinstance(node, ast.Call) and (name := _dynamic(node)) is not None:
            found.append((node.lineno, name))
    return found


def imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every pagedkv import in ``path``."""
    return [(line, name) for line, name in all_imports(path, root)
            if name.split(".")[0] == "pagedkv"]


def _ids(root: Path):
    return lambda p: str(p.relative_to(root))


def test_every_module_has_a_layer():
    for path in MODULES:
        if path != PACKAGE / "__init__.py":
            layer_of("pagedkv." + path.relative_to(PACKAGE).parts[0])


@pytest.mark.parametrize("path", MODULES, ids=_ids(PACKAGE))
def test_no_module_imports_a_higher_layer(path: Path):
    if path == PACKAGE / "__init__.py":
        own = len(LAYERS)
    else:
        own = layer_of("pagedkv." + path.relative_to(PACKAGE).parts[0])
    upward = [f"line {line}: {name}" for line, name in imports(path)
              if name != "pagedkv.__version__" and layer_of(name) > own]
    assert not upward, f"{path.relative_to(PACKAGE)} (layer {own}) imports a higher layer: " \
        f"{upward}"


@pytest.mark.parametrize("path", MODULES, ids=_ids(PACKAGE))
def test_no_module_imports_outside_the_package(path: Path):
    """The installed package has no bench/ and no tests/ beside it."""
    outside = [f"line {line}: {name}" for line, name in all_imports(path)
               if name.split(".")[0] in TESTS | {"bench"}]
    assert not outside, f"{path.relative_to(PACKAGE)} imports outside pagedkv: {outside}"


@pytest.mark.parametrize("path", MODULES, ids=_ids(PACKAGE))
def test_no_module_changes_the_import_path(path: Path):
    """Editing sys.path is how a module reaches what the installed package does not hold."""
    tree = ast.parse(path.read_text(), str(path))
    edits = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and node.attr == "path" and isinstance(node.value, ast.Name)
             and node.value.id == "sys"]
    assert not edits, f"{path.relative_to(PACKAGE)} uses sys.path at lines {edits}"


@pytest.mark.parametrize("path", BENCH_MODULES, ids=_ids(BENCH))
def test_bench_imports_the_package_and_itself_only(path: Path):
    own = {"bench", *(p.stem for p in BENCH_MODULES)}  # a script's sibling import as well
    tests = [f"line {line}: {name}" for line, name in all_imports(path, BENCH)
             if name.split(".")[0] in TESTS - own]
    assert not tests, f"bench/{path.relative_to(BENCH)} imports the test suite: {tests}"
    for _, name in imports(path, BENCH):
        layer_of(name)  # an existing layer (KeyError otherwise)


def test_the_checks_see_what_they_should(tmp_path):
    root = tmp_path / "pagedkv"
    (root / "blocks").mkdir(parents=True)
    bad = root / "blocks" / "bad.py"
    bad.write_text("import pagedkv.tools.cli\nfrom pagedkv.serving.engine import LLMEngine\n"
                   "def f():\n    from ..serving import model\n    from . import manager\n"
                   "import importlib, sys\nimportlib.import_module('bench.__main__')\n"
                   "__import__('helpers')\nfrom pagedkv import tools\n")
    found = imports(bad, root)
    assert found == [(1, "pagedkv.tools.cli"), (2, "pagedkv.serving.engine"),
                     (9, "pagedkv.tools"), (4, "pagedkv.serving"), (5, "pagedkv.blocks")]
    assert [layer_of(name) > 3 for _, name in found] == [True, True, True, True, False]
    others = {name for _, name in all_imports(bad, root)} - {name for _, name in found}
    assert others == {"importlib", "sys", "bench.__main__", "helpers"}
    assert {"helpers", "conftest", "setup", "tests"} <= TESTS and "bench" not in TESTS


def test_only_integrations_import_transformers():
    """transformers is an optional extra: only pagedkv.integrations may import it."""
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in MODULES
             if path.relative_to(PACKAGE).parts[0] != "integrations"
             for line, name in all_imports(path) if name.split(".")[0] == "transformers"]
    assert not found, f"modules outside pagedkv.integrations import transformers: {found}"
