"""The package's layering: a module imports only from its own layer and the layers below.

0 base (errors, checks) < 1 ops < 2 cache < 3 blocks < 4 serving < 5 tools, integrations;
``pagedkv/__init__`` re-exports the public API and is exempt. Imports inside functions count too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "pagedkv"
LAYERS = {"errors": 0, "checks": 0, "_C": 0, "_simt": 0, "ops": 1, "cache": 2, "blocks": 3,
          "serving": 4, "tools": 5, "integrations": 5}
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def layer_of(dotted: str) -> int:
    """The layer of ``pagedkv.x...`` (by its first component below pagedkv)."""
    parts = dotted.split(".")
    assert parts[0] == "pagedkv"
    if len(parts) == 1:
        return len(LAYERS)  # the package itself: the public API, above every layer
    return LAYERS[parts[1].removesuffix(".py")]


def imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every pagedkv import in ``path`` (a file under ``root``, the package
    folder), relative ones resolved."""
    module = "pagedkv." + ".".join(path.relative_to(root).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(
        ".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("pagedkv")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name == "pagedkv":  # from pagedkv import x: the layer of x
                found += [(node.lineno, f"pagedkv.{a.name}") for a in node.names]
            elif name.startswith("pagedkv"):
                found.append((node.lineno, name))
    return found


def test_every_module_has_a_layer():
    for path in MODULES:
        layer_of("pagedkv." + path.relative_to(PACKAGE).parts[0])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path: Path):
    own = layer_of("pagedkv." + path.relative_to(PACKAGE).parts[0])
    upward = [f"line {line}: {name}" for line, name in imports(path)
              if name != "pagedkv.__version__" and layer_of(name) > own]
    assert not upward, f"{path.relative_to(PACKAGE)} (layer {own}) imports a higher layer: " \
        f"{upward}"


def test_the_check_sees_upward_imports(tmp_path):
    root = tmp_path / "pagedkv"
    (root / "blocks").mkdir(parents=True)
    bad = root / "blocks" / "bad.py"
    bad.write_text("import pagedkv.tools.cli\nfrom pagedkv.serving.engine import LLMEngine\n"
                   "def f():\n    from ..serving import model\n    from . import manager\n")
    found = imports(bad, root)
    assert found == [(1, "pagedkv.tools.cli"), (2, "pagedkv.serving.engine"),
                     (4, "pagedkv.serving"), (5, "pagedkv.blocks")]
    assert [layer_of(name) > 3 for _, name in found] == [True, True, True, False]


def test_only_integrations_import_transformers():
    """transformers is an optional extra: only pagedkv.integrations may import it."""
    found = []
    for path in MODULES:
        if path.relative_to(PACKAGE).parts[0] == "integrations":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for name in names
                      if name.split(".")[0] == "transformers"]
    assert not found, f"modules outside pagedkv.integrations import transformers: {found}"
