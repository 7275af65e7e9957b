"""The package's layers: a folder each, imports running one way only (docs/design.md).

Every `import` of a keras_ring module in the package's sources counts, those
inside functions too: an import put off until a call is still a dependency.
"""

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_ring"
# Bottom to top; a module may import its own folder and the folders below it.
# The three adapters stand side by side and know nothing of each other.
LAYERS = {"core": 0, "tensorflow": 1, "jax": 1, "torch": 1, "keras": 2, "elastic": 3, "launcher": 4,
          "ray": 5}
# The public faces at the top, which re-export the layers' names.
PUBLIC_MODULES = {"__init__", "__main__", "callbacks", "timeline"}
# Horovod's module paths inside an adapter's folder that are faces of a layer
# above it (`horovod.torch.elastic`): they import upwards, and no module of
# the package imports them (the adapter's `__init__` loads them on first use).
HOROVOD_FACES = {"keras_ring.torch.elastic"}


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path):
    """The keras_ring modules (or packages) that a source file imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "keras_ring")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if target.split(".")[0] != "keras_ring":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if _exists(submodule) else target)
    found.discard(name)
    return found


def _exists(name):
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or any(
        path.parent.glob(path.name + ".*.so"))


def sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_sits_in_a_layer_or_is_a_public_face():
    strays = [str(p.relative_to(PACKAGE)) for p in sources()
              if p.parent == PACKAGE and p.stem not in PUBLIC_MODULES]
    assert not strays, f"modules outside the layers' folders: {strays}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= set(LAYERS), folders - set(LAYERS)


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_down_the_layers(path):
    name = module_name(path)
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in PUBLIC_MODULES or name in HOROVOD_FACES:
        return
    layer = LAYERS[parts[1]]
    wrong = []
    for target in sorted(imports(path)):
        target_parts = target.split(".")
        folder = target_parts[1] if len(target_parts) > 1 else None
        if folder == parts[1]:
            continue
        if folder not in LAYERS or LAYERS[folder] >= layer:
            wrong.append(target)
    assert not wrong, f"{name} (layer {parts[1]}) imports {wrong}, above it or beside it"


def test_no_module_imports_a_horovod_face():
    importers = {module_name(p): imports(p) & HOROVOD_FACES for p in sources()}
    assert not {m: f for m, f in importers.items() if f}


def test_no_module_imports_itself_round_a_circle():
    graph = {module_name(p): imports(p) for p in sources()}
    state = {}

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                circle = path[path.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(circle))
            if target in graph and target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The scan finds what it is there to find: a core module that imports the Keras layer."""
    fake = tmp_path / "keras_ring"
    (fake / "core").mkdir(parents=True)
    (fake / "keras").mkdir()
    (fake / "keras" / "_optimizer.py").write_text("")
    bad = fake / "core" / "_basics.py"
    bad.write_text("def f():\n    from keras_ring.keras import _optimizer\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert imports(bad) == {"keras_ring.keras._optimizer"}
    with pytest.raises(AssertionError, match="imports"):
        test_imports_run_down_the_layers(bad)
