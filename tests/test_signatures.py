"""No function of the package takes more than six positional parameters: past that, a call
reads as a row of values whose meaning depends on their order. Options go after ``*``, and
values that travel together are one named object (``RuleEntry``, ``StepOptions``, ...).

Excepted, by decorator: ``@triton.jit`` kernels and helpers, whose parameters are what a GPU
launch or an inlined call passes (their host side builds the arguments from named objects),
and ``torch.library`` operators, whose Python signature is the operator's schema."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lowbit_optim"
MOST_POSITIONAL = 6
EXCEPTED_DECORATORS = ("triton.jit", "torch.library.custom_op", ".register_fake")


def positional_parameters(function: ast.FunctionDef) -> list[str]:
    names = [a.arg for a in function.args.posonlyargs + function.args.args]
    return [name for name in names if name not in ("self", "cls")]


def is_excepted(function: ast.FunctionDef) -> bool:
    return any(marker in ast.unparse(decorator)
               for decorator in function.decorator_list for marker in EXCEPTED_DECORATORS)


def long_signatures(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_excepted(node):
            names = positional_parameters(node)
            if len(names) > MOST_POSITIONAL:
                found.append(f"{node.name} (line {node.lineno}): {len(names)} positional")
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_takes_more_than_six_positional_parameters(path):
    assert not long_signatures(path.read_text()), f"{path}: {long_signatures(path.read_text())}"


def test_the_check_sees_a_long_signature_and_the_exceptions():
    source = '''
def seven(a, b, c, d, e, f, g): ...
def six_then_options(a, b, c, d, e, f, *, g, h): ...
class Step:
    def method(self, a, b, c, d, e, f): ...
@triton.jit
def kernel(a, b, c, d, e, f, g): ...
'''
    assert long_signatures(source) == ["seven (line 2): 7 positional"]
