"""The package's import graph: no circles, and every module imports only from its own layer
or the layers below it (the map at the top of docs/design.md). Read from the source with
``ast``, so an upward import fails here before anyone has to find the circle at run time."""

import ast
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lowbit_optim"

# Bottom to top. ``reference`` holds plain-PyTorch references over the formats and the step's
# shared math (Muon's oracle uses the step's Newton-Schulz); ``lowbit_optim.functional``
# re-exports the functional API; ``lowbit_optim`` itself (its __init__, the public names) sits
# just below ``bench``, the one sub-package that may use the public API as a user would.
LAYERS = ["formats", "state", "step", "reference", "checkpoint", "optim", "offload", "integrations",
          "functional", "", "bench"]

# Imports inside functions are for optional dependencies only: the third-party packages a
# plain install does not have, and our modules that import one of them.
OPTIONAL = {"triton", "transformers", "torchao", "bitsandbytes", "tqdm", "matplotlib"}
NEEDS_OPTIONAL = {"lowbit_optim.step.kernels": "triton", "lowbit_optim.bench.plots": "matplotlib",
                  # imports setuptools, which a plain Python 3.12 environment lacks: the C++ CPU
                  # step then falls back with a warning instead of the package failing to import
                  "torch.utils.cpp_extension": "setuptools"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@functools.cache
def imports(module: str) -> tuple[tuple[str, bool], ...]:
    """``(imported module, inside a function)`` for each import of ``module``; a name
    imported from a package counts as its submodule when it is one."""
    tree = ast.parse(MODULES[module].read_text())
    nested = {id(node) for function in ast.walk(tree)
              if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(function) if node is not function}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES
                       else node.module for alias in node.names]
        else:
            continue
        found += [(target, id(node) in nested) for target in targets]
    return tuple(found)


def graph() -> dict[str, set[str]]:
    return {module: {target for target, _ in imports(module) if target in MODULES} for module in MODULES}


def test_layers_are_known():
    assert {layer(module) for module in MODULES} <= set(LAYERS)


@pytest.mark.parametrize("module", list(MODULES))
def test_module_imports_only_its_layer_or_below(module):
    own = LAYERS.index(layer(module))
    upward = [target for target in graph()[module] if LAYERS.index(layer(target)) > own]
    assert not upward, f"{module} (layer {layer(module)!r}) imports from higher layers: {upward}"


@pytest.mark.parametrize("module", list(MODULES))
def test_imports_inside_functions_are_for_optional_dependencies(module):
    lazy = [target for target, nested in imports(module) if nested]
    needless = [target for target in lazy
                if target.split(".")[0] not in OPTIONAL and target not in NEEDS_OPTIONAL]
    assert not needless, f"{module} imports {needless} inside a function; import it at the top"


def test_no_import_circles():
    edges = graph()
    done, path = set(), []

    def visit(module):
        if module in path:
            circle = path[path.index(module):] + [module]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if module in done:
            return
        path.append(module)
        for target in sorted(edges[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(edges):
        visit(module)


def test_checks_catch_an_upward_import_and_a_circle(monkeypatch):
    """The checks above can fail: an import from ``state`` up into ``step`` that closes a
    circle is reported by both."""
    real = imports

    def with_bad_import(module):
        extra = (("lowbit_optim.step.math", False),) if module == "lowbit_optim.state.quantized" else ()
        extra += (("lowbit_optim.state.quantized", False),) if module == "lowbit_optim.step.math" else ()
        return real(module) + extra

    monkeypatch.setitem(globals(), "imports", with_bad_import)
    with pytest.raises(AssertionError, match="higher layers"):
        test_module_imports_only_its_layer_or_below("lowbit_optim.state.quantized")
    with pytest.raises(AssertionError, match="import circle"):
        test_no_import_circles()
