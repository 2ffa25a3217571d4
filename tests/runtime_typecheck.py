"""The runtime type checker the tests run the library under.

`install()` (called by `conftest.py` before anything imports `eqx_offload`) makes
every function and class of the package type-checked at run time, as jaxtyping's own
import hook (`--jaxtyping-packages=eqx_offload,beartype.beartype`) does: the same
decorator position (last, so that `jax.custom_vjp` and Equinox's wrappers see a plain
function), `@typing.no_type_check` respected, `jaxtyping.config`'s `jaxtyping_disable`
respected, errors raised as `jaxtyping.TypeCheckError` with jaxtyping's message.

The difference is the price. `jaxtyped` keeps a memo of named dimensions for each call
(about 5 us on this machine, against 0.3 us for beartype alone), and the library's
small helpers are called millions of times in a test run. Only a signature that names
array shapes needs that memo: classes, and functions with a jaxtyping array (or a
string, not yet resolved) in their annotations, get `jaxtyped(typechecker=beartype)`
as before; every other function is checked by beartype alone, which checks the same
annotations. On a violation of its own parameters the jaxtyped version is called to
raise jaxtyping's error (the function has not run yet); a violation raised deeper, by
another checked function, passes through unchanged.
"""

import ast
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import typing
from collections.abc import Callable

import beartype
import jaxtyping
from beartype.roar import (
    BeartypeCallHintParamViolation,
    BeartypeCallHintReturnViolation,
)


_DECORATOR = "__eqx_offload_tests_typecheck__"


def _names_shapes(annotation: object) -> bool:
    """Whether an annotation needs jaxtyping's memo of named dimensions."""
    if isinstance(annotation, str | typing.ForwardRef):
        return True  # not resolved yet: let jaxtyping resolve it
    if isinstance(annotation, type) and issubclass(annotation, jaxtyping.AbstractArray):
        return True
    if getattr(annotation, "__module__", "").startswith("jaxtyping"):
        return True  # PyTree[...] and the like
    return any(_names_shapes(a) for a in typing.get_args(annotation))


# Code objects whose functions beartype leaves as they are (nothing to check).
_NOTHING_TO_CHECK: set = set()


def _jaxtyped(obj):
    return jaxtyping.jaxtyped(typechecker=beartype.beartype)(obj)


def check(obj):
    """The decorator `install()` puts on every function and class of the package."""
    if isinstance(obj, type) or any(
        _names_shapes(a) for a in getattr(obj, "__annotations__", {}).values()
    ):
        return _jaxtyped(obj)
    code = getattr(obj, "__code__", None)
    if code in _NOTHING_TO_CHECK:  # a nested function, defined again at each call
        return obj
    fast = beartype.beartype(obj)
    if fast is obj:  # nothing annotated, or only with `Any`
        if code is not None:
            _NOTHING_TO_CHECK.add(code)
        return obj
    checked = _wrapper(obj, fast)
    return functools.wraps(obj)(checked)


# The wrapper is generated code named as beartype's own wrappers are
# (`<@beartype(...)>`): the library attributes saved values to the user's line,
# skipping type checkers' wrappers, so this one must not look like a line of the
# tests.
_WRAPPER = """
def _wrapper(obj, fast):
    def checked(*args, **kwargs):
        __tracebackhide__ = True
        if jaxtyping.config.jaxtyping_disable:
            return obj(*args, **kwargs)
        try:
            return fast(*args, **kwargs)
        except (BeartypeCallHintParamViolation, BeartypeCallHintReturnViolation) as e:
            tb = e.__traceback__
            if tb is None or tb.tb_next is None or tb.tb_next.tb_next is not None:
                raise  # raised deeper: another function's violation
            if isinstance(e, BeartypeCallHintParamViolation):
                _jaxtyped(obj)(*args, **kwargs)  # raises jaxtyping's error first
            name = f"{obj.__module__}.{obj.__qualname__}"
            raise jaxtyping.TypeCheckError(
                f"Type-check error whilst checking {name}: {e}"
            ) from e

    return checked
"""
_namespace = {
    "jaxtyping": jaxtyping,
    "BeartypeCallHintParamViolation": BeartypeCallHintParamViolation,
    "BeartypeCallHintReturnViolation": BeartypeCallHintReturnViolation,
    "_jaxtyped": _jaxtyped,
}
exec(compile(_WRAPPER, "<@beartype(runtime_typecheck)>", "exec"), _namespace)
_wrapper: Callable[[Callable, Callable], Callable] = _namespace["_wrapper"]


class _Decorate(ast.NodeTransformer):
    """Appends `@check` to every function and class, outside `@no_type_check`."""

    def _visit(self, node):
        if any(_is_no_type_check(d) for d in node.decorator_list):
            return node  # neither it nor what it defines inside
        decorator = ast.copy_location(ast.Name(_DECORATOR, ast.Load()), node)
        if isinstance(node, ast.ClassDef):
            node.decorator_list.insert(0, decorator)  # after `@dataclass`-likes
        else:
            node.decorator_list.append(decorator)
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit


def _is_no_type_check(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Name) and node.id == "no_type_check") or (
        isinstance(node, ast.Attribute) and node.attr == "no_type_check"
    )


class _Loader(importlib.machinery.SourceFileLoader):
    """Compiles the decorated source; never reads or writes bytecode caches (the
    plain `.pyc` files stay the undecorated ones)."""

    def get_code(self, fullname):
        source = importlib.util.decode_source(self.get_data(self.path))
        tree = _Decorate().visit(ast.parse(source, self.path))
        return compile(ast.fix_missing_locations(tree), self.path, "exec")

    def exec_module(self, module):
        module.__dict__[_DECORATOR] = check
        super().exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path, target=None):
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(
            spec.loader, importlib.machinery.SourceFileLoader
        ):
            return spec
        spec.loader = _Loader(fullname, spec.origin)  # pyright: ignore
        return spec


def install(package: str) -> Callable[[], None]:
    """Type-checks `package` from its next import on; returns the uninstaller."""
    if package in sys.modules:
        raise RuntimeError(f"{package} was imported before the type checker")
    finder = _Finder(package)
    sys.meta_path.insert(0, finder)
    return lambda: sys.meta_path.remove(finder)
