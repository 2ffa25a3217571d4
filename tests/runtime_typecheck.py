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
import copy
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import typing
import weakref
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
    if typing.get_origin(annotation) is typing.Literal:
        return False  # its strings are values, not names to resolve
    return any(_names_shapes(a) for a in typing.get_args(annotation))


# Code objects whose functions beartype leaves as they are (nothing to check).
_NOTHING_TO_CHECK: set = set()


def _jaxtyped(obj):
    return jaxtyping.jaxtyped(typechecker=beartype.beartype)(obj)


def check(obj):
    """The decorator `install()` puts on every function and class of the package."""
    if isinstance(obj, type):
        return _jaxtyped(obj)
    if any(_names_shapes(a) for a in getattr(obj, "__annotations__", {}).values()):
        return _reused(obj, _jaxtyped, _JAXTYPED)
    code = getattr(obj, "__code__", None)
    if code in _NOTHING_TO_CHECK:  # a nested function, defined again at each call
        return obj
    fast = _reused(obj, beartype.beartype, _BEARTYPED)
    if fast is obj:  # nothing annotated, or only with `Any`
        if code is not None:
            _NOTHING_TO_CHECK.add(code)
        return obj
    checked = _wrapper(obj, fast)
    return functools.wraps(obj)(checked)


# A nested function is defined again at each call of the function around it, and
# its checker made again each time (beartype and jaxtyping generate and compile
# code for its signature): 4% of a test run's time. So the checker of the first is
# kept, per code object and the annotations and defaults it was made for (the same
# objects, not equal ones; jaxtyping's array types by their spelling), without the
# function; a later function of that code with those annotations and defaults gets
# a copy bound to itself: the same generated checks, calling it, its errors naming
# it. Kept: up to 4 per code object, with defaults of plain values only, and of the
# form expected (beartype 0.23's wrapper, jaxtyping 0.3's closure), else made anew.
_TEMPLATES: dict = {}


def _reused(obj, make, kind):
    code = getattr(obj, "__code__", None)
    if code is None:
        return make(obj)
    defaults = (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values())
    identity = (*obj.__annotations__.values(), *defaults)
    for kept_kind, kept_identity, template in _TEMPLATES.get(code, ()):
        if kept_kind is kind and _same(kept_identity, identity):
            return kind.bind(template, obj)
    made = make(obj)
    kept = _TEMPLATES.setdefault(code, [])
    if "<locals>" in obj.__qualname__ and made is not obj and len(kept) < 4:
        template = kind.strip(made)
        if template is not None and all(isinstance(d, _SMALL) for d in defaults):
            kept.append((kind, identity, template))
    return made


# Defaults kept with a checker: none that could hold on to a model or a program.
_SMALL = (type(None), bool, int, float, str, type)


def _same(xs: tuple, ys: tuple) -> bool:
    return len(xs) == len(ys) and all(map(_alike, xs, ys))


def _alike(x, y) -> bool:
    """The same object; or jaxtyping array types of one spelling (it makes a new
    class at each `Float[Array, "n"]`), alone or in the same generic."""
    if x is y:
        return True
    if isinstance(x, type) and issubclass(x, jaxtyping.AbstractArray):
        return type(x) is type(y) and _spelling(x) == _spelling(y)
    origin = typing.get_origin(x)
    return (
        origin is not None
        and origin is typing.get_origin(y)
        and _same(typing.get_args(x), typing.get_args(y))
    )


def _spelling(array: type) -> tuple:
    names = ("dtype", "array_type", "dim_str", "dtypes", "index_variadic")
    return tuple(getattr(array, name, None) for name in names)


def _function(f, name, closure):
    return types.FunctionType(f.__code__, f.__globals__, name, f.__defaults__, closure)


def _closure(f, **cells) -> tuple:
    """`f`'s closure with the cells named in `cells` replaced."""
    pairs = zip(f.__code__.co_freevars, f.__closure__ or ())
    return tuple(cells.get(name, cell) for name, cell in pairs)


class _BEARTYPED:
    """beartype's wrapper: its function, and the call data its errors name it by,
    are keyword-only defaults."""

    FUNC, CALL = "__beartype_func", "__beartype_call_curr"

    @classmethod
    def strip(cls, fast):
        defaults = getattr(fast, "__kwdefaults__", None) or {}
        if not isinstance(defaults.get(cls.FUNC), types.FunctionType) or not hasattr(
            defaults.get(cls.CALL), "decoratee"
        ):
            return None
        call = copy.copy(defaults[cls.CALL])
        call.decoratee = call.decoratee_annotations = None
        attributes = {k: v for k, v in fast.__dict__.items() if k != "__wrapped__"}
        bare = _function(fast, fast.__name__, fast.__closure__)
        return bare, {**defaults, cls.FUNC: None, cls.CALL: call}, attributes

    @classmethod
    def bind(cls, template, obj):
        fast, defaults, attributes = template
        call = copy.copy(defaults[cls.CALL])
        call.decoratee, call.decoratee_annotations = obj, obj.__annotations__
        bound = _function(fast, obj.__name__, fast.__closure__)
        bound.__kwdefaults__ = {**defaults, cls.FUNC: obj, cls.CALL: call}
        functools.update_wrapper(bound, obj)
        bound.__dict__.update(attributes)
        return bound


class _JAXTYPED:
    """jaxtyping's wrapper: a closure over the function (`fn`), its own weak
    reference and the function that checks and calls it (also over `fn`)."""

    OUTER = ("fn", "param_signature", "wrapped_fn_holder", "wrapped_fn_impl")

    @classmethod
    def strip(cls, wrapped):
        code = getattr(wrapped, "__code__", None)
        if code is None or code.co_freevars != cls.OUTER:
            return None
        inner = dict(zip(code.co_freevars, wrapped.__closure__))["wrapped_fn_impl"]
        inner = inner.cell_contents
        if "fn" not in inner.__code__.co_freevars:
            return None
        return cls._bound((wrapped, inner), None, [])

    @classmethod
    def bind(cls, template, obj):
        holder = []
        bound = cls._bound(template, obj, holder)[0]
        holder.append(weakref.ref(bound))
        return functools.update_wrapper(bound, obj)

    @staticmethod
    def _bound(template, obj, holder) -> tuple:
        """Copies of the wrapper and of the function it calls, over `obj`."""
        wrapped, inner = template
        fn = types.CellType(obj)
        inner = _function(inner, inner.__name__, _closure(inner, fn=fn))
        cells = {"fn": fn, "wrapped_fn_holder": types.CellType(holder)}
        cells["wrapped_fn_impl"] = types.CellType(inner)
        return _function(wrapped, wrapped.__name__, _closure(wrapped, **cells)), inner


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
