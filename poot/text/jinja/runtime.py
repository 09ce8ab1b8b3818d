"""The interpreter's run time: the errors, the values (`Undefined`, markup, namespaces, loops,
macros), the sandbox's attribute, item and call rules and size bounds, and scopes. It knows
nothing of a template's text or syntax (lexer.py, parser.py) nor of single filters (filters.py)."""
import math

from poot.errors import TemplateError

MAX_SEQUENCE = 10_000_000      # repetition, padding and powers that would build more than this are refused


class JinjaSyntaxError(TemplateError):
    """The template source is not valid (for this interpreter); names line and column."""

    def __init__(self, message, lineno=None, column=None):
        self.message, self.lineno, self.column = message, lineno, column
        where = f"line {lineno}, column {column}: " if lineno is not None else ""
        super().__init__(f"template syntax error: {where}{message}")


class JinjaRuntimeError(TemplateError):
    """Rendering failed: an undefined value was used, an operation failed, or the template said so."""

    def __init__(self, message, lineno=None):
        self.message, self.lineno = message, lineno
        super().__init__(message if lineno is None else f"{message} (template line {lineno})")

    def at_line(self, lineno):
        return self if self.lineno is not None else type(self)(self.message, lineno)


class JinjaSecurityError(JinjaRuntimeError):
    """The template reached for something the sandbox refuses."""


class RaisedByTemplate(JinjaRuntimeError):
    """`raise_exception(message)` was called: the message is the template's own, verbatim."""

    def __init__(self, message, lineno=None):
        self.message, self.lineno = message, lineno
        TemplateError.__init__(self, message)

    def at_line(self, lineno):
        return self


# --------------------------------------------------------------------------------------- values

class Undefined:
    """A missing value: prints as "", is falsy and empty; any other use raises (Jinja's default)."""
    __slots__ = ("hint", "error")

    def __init__(self, hint, error=JinjaRuntimeError):
        self.hint, self.error = hint, error

    def fail(self, *_args, **_kwargs):
        raise self.error(self.hint)

    def __str__(self):
        return ""

    def __repr__(self):
        return "Undefined"

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __bool__(self):
        return False

    def __eq__(self, other):
        return type(self) is type(other)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return id(type(self))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = fail
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = fail
    __pos__ = __neg__ = __pow__ = __rpow__ = __call__ = __getitem__ = fail
    __lt__ = __le__ = __gt__ = __ge__ = __int__ = __float__ = __complex__ = fail


def _type_name(obj):
    return "None" if obj is None else f"{type(obj).__name__} object"


def undefined_name(name):
    return Undefined(f"{name!r} is undefined")


def undefined_attribute(obj, name):
    if isinstance(name, str):
        return Undefined(f"{_type_name(obj)!r} has no attribute {name!r}")
    return Undefined(f"{_type_name(obj)} has no element {name!r}")


def refused(obj, name, why="is unsafe"):
    return Undefined(f"access to attribute {name!r} of {type(obj).__name__!r} object {why}.",
                     JinjaSecurityError)


class Markup(str):
    """Text marked safe by `|safe` or `|escape`: plain text joined to it with `+` or `%` is escaped."""
    __slots__ = ()

    def __add__(self, other):
        if isinstance(other, str):
            return Markup(str.__add__(self, escape(other)))
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, str):
            return Markup(str.__add__(escape(other), self))
        return NotImplemented

    def __mul__(self, n):
        return Markup(str.__mul__(self, n))

    __rmul__ = __mul__

    def __mod__(self, args):
        args = tuple(map(escape, args)) if isinstance(args, tuple) else escape(args)
        return Markup(str.__mod__(self, args))


def escape(value):
    if isinstance(value, Markup):
        return value
    text = str(value).replace("&", "&amp;").replace(">", "&gt;").replace("<", "&lt;")
    return Markup(text.replace("'", "&#39;").replace('"', "&#34;"))


class Namespace:
    """`namespace(...)`: the one object whose attributes `{% set ns.x = ... %}` may change."""
    __slots__ = ("attrs",)

    def __init__(self, *args, **kwargs):
        self.attrs = dict(*args, **kwargs)

    def __repr__(self):
        return f"<Namespace {self.attrs!r}>"


class Function:
    """A callable the sandbox trusts: a global, a loop helper, `raise_exception`."""
    __slots__ = ("name", "fn")

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self):
        return f"<function {self.name}>"


class Loop:
    """The `loop` variable inside `{% for %}` (depth is always 1: loops are not recursive)."""
    __slots__ = ("items", "index0", "last_changed")

    def __init__(self, items):
        self.items, self.index0, self.last_changed = items, 0, _MISSING

    def attribute(self, name):
        i, n = self.index0, len(self.items)
        counts = {"index": i + 1, "index0": i, "revindex": n - i, "revindex0": n - i - 1,
                  "first": i == 0, "last": i == n - 1, "length": n, "depth": 1, "depth0": 0}
        if name in counts:
            return counts[name]
        if name == "previtem":
            return self.items[i - 1] if i > 0 else Undefined("there is no previous item")
        if name == "nextitem":
            return self.items[i + 1] if i + 1 < n else Undefined("there is no next item")
        if name in ("cycle", "changed"):
            return Function(f"loop.{name}", getattr(self, name))
        return undefined_attribute(self, name)

    def cycle(self, *args):
        if not args:
            raise TypeError("no items for cycling given")
        return args[self.index0 % len(args)]

    def changed(self, *value):
        if value != self.last_changed:
            self.last_changed = value
            return True
        return False

    def __repr__(self):
        return f"<LoopContext {self.index0 + 1}/{len(self.items)}>"


_MISSING = object()

# The methods a template may call, by the type they belong to; every other attribute that Python
# has on these types is refused. Mutating list/dict methods are refused as Jinja's immutable
# sandbox refuses them; str.format is refused because only Jinja's own sandboxed formatter makes
# it safe.
_SAFE_METHODS = {
    str: frozenset("""capitalize casefold center count endswith expandtabs find index isalnum isalpha
        isascii isdecimal isdigit isidentifier islower isnumeric isprintable isspace istitle isupper
        join ljust lower lstrip partition removeprefix removesuffix replace rfind rindex rjust
        rpartition rsplit rstrip split splitlines startswith strip swapcase title upper zfill""".split()),
    dict: frozenset("get keys values items copy".split()),
    list: frozenset("index count copy".split()),
    tuple: frozenset("index count".split()),
}
_MUTATING = frozenset("append extend insert pop remove reverse sort clear update setdefault popitem".split())
_PADDING = frozenset("center ljust rjust zfill expandtabs".split())


def _method_owner(obj):
    for owner in (str, dict, list, tuple):
        if isinstance(obj, owner):
            return owner
    return None


def get_attribute(obj, name):
    """`obj.name`: a method first (as Python getattr), then the dict key; else undefined."""
    if isinstance(obj, Undefined):
        obj.fail()
    if isinstance(obj, Namespace):
        return obj.attrs[name] if name in obj.attrs else undefined_attribute(obj, name)
    if isinstance(obj, Loop):
        return obj.attribute(name)
    owner = _method_owner(obj)
    if owner is not None and hasattr(owner, name):
        if name in _SAFE_METHODS[owner]:
            return getattr(obj, name)
        if name in _MUTATING or name.startswith("_"):
            return refused(obj, name)
        return refused(obj, name, "is not supported by poot's template sandbox")
    if owner is dict and name in obj:
        return obj[name]
    if obj is not None and owner is None and not isinstance(obj, (int, float, Macro)):
        return refused(obj, name, "is not reachable from a template")
    if name.startswith("_") and hasattr(obj, name):
        return refused(obj, name)
    return undefined_attribute(obj, name)


def get_item(obj, key):
    """`obj[key]`: the item first, then (for a string key) the attribute; else undefined."""
    if isinstance(obj, Undefined):
        obj.fail()
    if isinstance(obj, (dict, list, tuple, str, range)):
        try:
            return obj[key]
        except (TypeError, LookupError):
            pass
    if isinstance(key, str):
        return get_attribute(obj, key)
    return undefined_attribute(obj, key)


def to_str(value):
    return value if isinstance(value, str) else str(value)


def check_size(n):
    if n > MAX_SEQUENCE:
        raise JinjaSecurityError(f"the result would hold {n} items; the sandbox allows {MAX_SEQUENCE}")


def multiply(a, b):
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            check_size(len(seq) * max(n, 0))
    return a * b


def power(a, b):
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        check_size(int(b * math.log2(abs(a))) // 8)
    return a ** b


def call(fn, args, kwargs):
    """Call `fn` if the sandbox trusts it."""
    if isinstance(fn, (Macro, Function)):
        return fn(*args, **kwargs)
    if isinstance(fn, Undefined):
        fn.fail()
    owner = _method_owner(getattr(fn, "__self__", None))
    if owner is not None and type(fn).__name__ == "builtin_function_or_method" \
            and fn.__name__ in _SAFE_METHODS[owner]:
        if fn.__name__ in _PADDING and args and isinstance(args[0], int):
            check_size(args[0])
        return fn(*args, **kwargs)
    raise JinjaSecurityError(f"{_type_name(fn)} is not callable from a template")


# -------------------------------------------------------------------------------------- scopes

class Scope:
    """Variables of one level: the template, one loop iteration, one macro call, a block."""
    __slots__ = ("vars", "parent")

    def __init__(self, vars, parent):
        self.vars, self.parent = vars, parent


class BreakLoop(Exception):
    pass


class ContinueLoop(Exception):
    pass


def evaluate(expr, scope, **extra):
    """Evaluate an expression of a statement (`extra`: a call's further keywords), turning Python
    errors into a runtime error at its line."""
    try:
        return expr.eval(scope, **extra)
    except JinjaRuntimeError as e:
        raise e.at_line(expr.line) from None
    except TemplateError:
        raise
    except RecursionError:
        raise JinjaRuntimeError("the template recursed too deeply", expr.line) from None
    except Exception as e:
        raise JinjaRuntimeError(f"{type(e).__name__}: {e}", expr.line) from None


def render_body(body, scope, out):
    for node in body:
        node.render(scope, out)


def lookup(scope, name):
    while scope is not None:
        if name in scope.vars:
            return scope.vars[name]
        scope = scope.parent
    return undefined_name(name)


def bind(target, value, scope, line=None):
    """Bind a name, or unpack a value into a tuple of names."""
    if isinstance(target, str):
        scope.vars[target] = value
        return
    try:
        values = list(value)
    except TypeError as e:
        raise JinjaRuntimeError(f"cannot unpack: {e}", line) from None
    if len(values) != len(target):
        raise JinjaRuntimeError(f"cannot unpack {len(values)} values into {len(target)} names", line)
    for name, v in zip(target, values):
        bind(name, v, scope, line)


class Macro:
    """A `{% macro %}` bound to the scope it was defined in; calling it renders its body."""
    __slots__ = ("name", "params", "defaults", "body", "scope")

    def __init__(self, name, params, defaults, body, scope):
        self.name, self.params, self.defaults, self.body, self.scope = name, params, defaults, body, scope

    def __call__(self, *args, **kwargs):
        caller = kwargs.pop("caller", None)
        local = {}
        scope = Scope(local, self.scope)
        first_default = len(self.params) - len(self.defaults)
        for i, name in enumerate(self.params):
            if i < len(args):
                local[name] = args[i]
            elif name in kwargs:
                local[name] = kwargs.pop(name)
            elif i >= first_default:
                local[name] = evaluate(self.defaults[i - first_default], scope)
            else:
                local[name] = Undefined(f"parameter {name!r} was not provided")
        local["varargs"] = tuple(args[len(self.params):])
        local["kwargs"] = kwargs
        if caller is not None:
            local["caller"] = caller
        out = []
        render_body(self.body, scope, out)
        return "".join(out)

    def __repr__(self):
        return f"<Macro {self.name!r}>"
