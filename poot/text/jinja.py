"""A sandboxed interpreter of the Jinja template language, as Hugging Face renders chat templates.

Model files carry their chat template as Jinja source; this module lexes it, parses it to an AST and
walks the AST, with the semantics of Jinja2's `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` plus the loop-controls extension and the globals Hugging Face adds
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text). Templates come from files
users download, so the sandbox is strict: values are plain data (str, numbers, bool, None, lists,
tuples, dicts), attributes starting with `_` and methods that mutate are refused, and the only
callables a template can reach are its own macros, the globals below and a fixed list of
non-mutating str/dict/list methods. It is not Jinja's file system: no `include`, `import`,
`extends`, `block`, recursive loops, `str.format` or autoescaping; those raise `JinjaSyntaxError` or
`JinjaSecurityError` naming the construct.
"""
import datetime
import json
import math
import re
from bisect import bisect_right

from poot.errors import TemplateError

MAX_RANGE = 100_000            # as Jinja's sandbox: range() longer than this is refused
MAX_SEQUENCE = 10_000_000      # repetition, padding and powers that would build more than this are refused

clock = datetime.datetime.now  # what strftime_now reads; tests replace it with a fixed time


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
        if name == "index":
            return i + 1
        if name == "index0":
            return i
        if name == "revindex":
            return n - i
        if name == "revindex0":
            return n - i - 1
        if name == "first":
            return i == 0
        if name == "last":
            return i == n - 1
        if name == "length":
            return n
        if name == "depth":
            return 1
        if name == "depth0":
            return 0
        if name == "previtem":
            return self.items[i - 1] if i > 0 else Undefined("there is no previous item")
        if name == "nextitem":
            return self.items[i + 1] if i + 1 < n else Undefined("there is no next item")
        if name == "cycle":
            return Function("loop.cycle", self.cycle)
        if name == "changed":
            return Function("loop.changed", self.changed)
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
    if isinstance(value, str):
        return value
    return str(value)


def _check_size(n):
    if n > MAX_SEQUENCE:
        raise JinjaSecurityError(f"the result would hold {n} items; the sandbox allows {MAX_SEQUENCE}")


def _multiply(a, b):
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            _check_size(len(seq) * max(n, 0))
    return a * b


def _power(a, b):
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        _check_size(int(b * math.log2(abs(a))) // 8)
    return a ** b


def _call(fn, args, kwargs):
    """Call `fn` if the sandbox trusts it."""
    if isinstance(fn, (Macro, Function)):
        return fn(*args, **kwargs)
    if isinstance(fn, Undefined):
        fn.fail()
    owner = _method_owner(getattr(fn, "__self__", None))
    if owner is not None and type(fn).__name__ == "builtin_function_or_method" \
            and fn.__name__ in _SAFE_METHODS[owner]:
        if fn.__name__ in _PADDING and args and isinstance(args[0], int):
            _check_size(args[0])
        return fn(*args, **kwargs)
    raise JinjaSecurityError(f"{_type_name(fn)} is not callable from a template")


# ------------------------------------------------------------------------------------ filters

def _soft_str(value):
    return value if isinstance(value, str) else str(value)


def _attribute_getter(attribute, default=None):
    parts = [int(p) if p.isdigit() else p for p in attribute.split(".")] \
        if isinstance(attribute, str) else [attribute]

    def get(item):
        for part in parts:
            item = get_item(item, part)
        if default is not None and isinstance(item, Undefined):
            return default
        return item
    return get


def _sort_key(case_sensitive, attribute=None):
    get = _attribute_getter(attribute) if attribute is not None else (lambda x: x)

    def key(item):
        value = get(item)
        return value.lower() if not case_sensitive and isinstance(value, str) else value
    return key


def f_default(value, default_value="", boolean=False):
    if isinstance(value, Undefined) or (boolean and not value):
        return default_value
    return value


def f_first(seq):
    for item in seq:
        return item
    return Undefined("No first item, sequence was empty.")


def f_last(seq):
    for item in reversed(seq):
        return item
    return Undefined("No last item, sequence was empty.")


def f_join(value, d="", attribute=None):
    if attribute is not None:
        value = map(_attribute_getter(attribute), value)
    return str(d).join(map(str, value))


def f_int(value, default=0, base=10):
    try:
        return int(value, base) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError):
            return default


def f_float(value, default=0.0):
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def f_replace(s, old, new, count=None):
    return str(s).replace(str(old), str(new), -1 if count is None else count)


_WORD_BEGINNING = re.compile(r"([-\s({\[<]+)")


def f_title(s):
    return "".join(p[0].upper() + p[1:].lower() for p in _WORD_BEGINNING.split(_soft_str(s)) if p)


def f_tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Hugging Face's tojson: json.dumps, non-ASCII kept, no HTML escaping.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def f_items(value):
    if isinstance(value, Undefined):
        return iter(())
    if not isinstance(value, dict):
        raise TypeError("Can only get item pairs from a mapping.")
    return iter(list(value.items()))


def f_dictsort(value, case_sensitive=False, by="key", reverse=False):
    if by not in ("key", "value"):
        raise ValueError("You can only sort by either 'key' or 'value'")
    pos = 0 if by == "key" else 1
    key = _sort_key(case_sensitive)
    return sorted(value.items(), key=lambda item: key(item[pos]), reverse=reverse)


def f_sort(value, reverse=False, case_sensitive=False, attribute=None):
    return sorted(value, key=_sort_key(case_sensitive, attribute), reverse=reverse)


def f_unique(value, case_sensitive=False, attribute=None):
    key, seen, out = _sort_key(case_sensitive, attribute), set(), []
    for item in value:
        k = key(item)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return iter(out)


def f_min_max(pick):
    def f(value, case_sensitive=False, attribute=None):
        items = list(value)
        if not items:
            return Undefined("No aggregated item, sequence was empty.")
        return pick(items, key=_sort_key(case_sensitive, attribute))
    return f


def f_sum(iterable, attribute=None, start=0):
    if attribute is not None:
        iterable = map(_attribute_getter(attribute), iterable)
    return sum(iterable, start)


def f_reverse(value):
    if isinstance(value, str):
        return value[::-1]
    try:
        return reversed(value)
    except TypeError:
        return iter(list(value)[::-1])


def f_indent(s, width=4, first=False, blank=False):
    indention = width if isinstance(width, str) else " " * width
    if not isinstance(width, str):
        _check_size(width)
    newline = Markup("\n") if isinstance(s, Markup) else "\n"
    s += newline
    if blank:
        rv = (newline + indention).join(s.splitlines())
    else:
        lines = s.splitlines()
        rv = lines.pop(0)
        if lines:
            rv += newline + newline.join(indention + line if line else line for line in lines)
    return indention + rv if first else rv


def f_center(value, width=80):
    _check_size(width)
    return _soft_str(value).center(width)


def f_round(value, precision=0, method="common"):
    if method == "common":
        return round(value, precision)
    if method not in ("ceil", "floor"):
        raise ValueError("method must be common, ceil or floor")
    return getattr(math, method)(value * (10 ** precision)) / (10 ** precision)


def f_batch(value, linecount, fill_with=None):
    out, tmp = [], []
    for item in value:
        if len(tmp) == linecount:
            out.append(tmp)
            tmp = []
        tmp.append(item)
    if tmp:
        if fill_with is not None and len(tmp) < linecount:
            tmp += [fill_with] * (linecount - len(tmp))
        out.append(tmp)
    return iter(out)


def f_format(value, *args, **kwargs):
    if args and kwargs:
        raise ValueError("can't handle positional and keyword arguments at the same time")
    return _soft_str(value) % (kwargs or args)


def f_attr(obj, name):
    # Python's getattr only: a dict's keys are not its attributes.
    if isinstance(obj, dict) and not hasattr(dict, name):
        return undefined_attribute(obj, name)
    return get_attribute(obj, name)


def f_map(value, *args, **kwargs):
    if not value:
        return iter(())
    if "attribute" in kwargs:
        get = _attribute_getter(kwargs.pop("attribute"), kwargs.pop("default", None))
        if kwargs or args:
            raise ValueError("Unexpected keyword argument for map with attribute")
        return iter([get(item) for item in value])
    if not args:
        raise ValueError("map requires a filter argument")
    name, args = args[0], args[1:]
    if name not in FILTERS:
        raise JinjaRuntimeError(f"No filter named {name!r}.")
    fn = FILTERS[name]
    return iter([fn(item, *args, **kwargs) for item in value])


def _select(keep, lookup_attr):
    def f(value, *args, **kwargs):
        if not value:
            return iter(())
        get = lambda x: x  # noqa: E731
        if lookup_attr:
            if not args:
                raise ValueError("Missing parameter for attribute name")
            get, args = _attribute_getter(args[0]), args[1:]
        if args:
            name, args = args[0], args[1:]
            if name not in TESTS:
                raise JinjaRuntimeError(f"No test named {name!r}.")
            test = TESTS[name]
            check = lambda item: test(item, *args, **kwargs)  # noqa: E731
        else:
            check = bool
        return iter([item for item in value if bool(check(get(item))) == keep])
    return f


FILTERS = {
    "abs": abs,
    "attr": f_attr,
    "batch": f_batch,
    "capitalize": lambda s: _soft_str(s).capitalize(),
    "center": f_center,
    "count": len,
    "d": f_default,
    "default": f_default,
    "dictsort": f_dictsort,
    "e": escape,
    "escape": escape,
    "first": f_first,
    "float": f_float,
    "forceescape": lambda value: escape(str(value)),
    "format": f_format,
    "indent": f_indent,
    "int": f_int,
    "items": f_items,
    "join": f_join,
    "last": f_last,
    "length": len,
    "list": list,
    "lower": lambda s: _soft_str(s).lower(),
    "map": f_map,
    "max": f_min_max(max),
    "min": f_min_max(min),
    "reject": _select(False, False),
    "rejectattr": _select(False, True),
    "replace": f_replace,
    "reverse": f_reverse,
    "round": f_round,
    "safe": lambda value: Markup(str(value)),
    "select": _select(True, False),
    "selectattr": _select(True, True),
    "sort": f_sort,
    "string": _soft_str,
    "sum": f_sum,
    "title": f_title,
    "tojson": f_tojson,
    "trim": lambda value, chars=None: _soft_str(value).strip(chars),
    "unique": f_unique,
    "upper": lambda s: _soft_str(s).upper(),
    "wordcount": lambda s: len(re.findall(r"\w+", _soft_str(s))),
}


# -------------------------------------------------------------------------------------- tests

def _is_number(value):
    return isinstance(value, (int, float, complex))


def _is_iterable(value):
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _is_sequence(value):
    try:
        len(value)
        value.__getitem__  # noqa: B018 (Jinja's test: has length and item access)
    except Exception:
        return False
    return True


TESTS = {
    "boolean": lambda v: v is True or v is False,
    "callable": callable,
    "defined": lambda v: not isinstance(v, Undefined),
    "divisibleby": lambda v, num: v % num == 0,
    "eq": lambda a, b: a == b,
    "equalto": lambda a, b: a == b,
    "==": lambda a, b: a == b,
    "escaped": lambda v: isinstance(v, Markup),
    "even": lambda v: v % 2 == 0,
    "false": lambda v: v is False,
    "filter": lambda v: v in FILTERS,
    "float": lambda v: isinstance(v, float),
    "ge": lambda a, b: a >= b,
    ">=": lambda a, b: a >= b,
    "gt": lambda a, b: a > b,
    "greaterthan": lambda a, b: a > b,
    ">": lambda a, b: a > b,
    "in": lambda v, seq: v in seq,
    "integer": lambda v: isinstance(v, int) and v is not True and v is not False,
    "iterable": _is_iterable,
    "le": lambda a, b: a <= b,
    "<=": lambda a, b: a <= b,
    "lower": lambda v: str(v).islower(),
    "lt": lambda a, b: a < b,
    "lessthan": lambda a, b: a < b,
    "<": lambda a, b: a < b,
    "mapping": lambda v: isinstance(v, dict),
    "ne": lambda a, b: a != b,
    "!=": lambda a, b: a != b,
    "none": lambda v: v is None,
    "number": _is_number,
    "odd": lambda v: v % 2 == 1,
    "sameas": lambda a, b: a is b,
    "sequence": _is_sequence,
    "string": lambda v: isinstance(v, str),
    "test": lambda v: v in TESTS,
    "true": lambda v: v is True,
    "undefined": lambda v: isinstance(v, Undefined),
    "upper": lambda v: str(v).isupper(),
}


# -------------------------------------------------------------------------------------- lexer

_NEWLINES = re.compile(r"\r\n|\r|\n")
_TAG_START = re.compile(r"\{([{%#])([-+]?)")
_RAW_BEGIN = re.compile(r"\{%([-+]?)\s*raw\s*(?:-%\}\s*|%\})")
_RAW_END = re.compile(r"\{%([-+]?)\s*endraw\s*(?=[-+]?%\})")
_COMMENT_END = re.compile(r"[-+]?#\}")
_WHITESPACE = re.compile(r"\s+")
_FLOAT = re.compile(r"(?<!\.)(\d+_)*\d+((\.(\d+_)*\d+)?e[+\-]?(\d+_)*\d+|\.(\d+_)*\d+)", re.I)
_INTEGER = re.compile(r"0b(_?[0-1])+|0o(_?[0-7])+|0x(_?[\da-f])+|[1-9](_?\d)*|0(_?0)*", re.I)
_NAME = re.compile(r"[^\W\d]\w*")
_STRING = re.compile(r"'([^'\\]*(?:\\.[^'\\]*)*)'|\"([^\"\\]*(?:\\.[^\"\\]*)*)\"", re.S)
_OPERATOR = re.compile(r"//|\*\*|==|!=|>=|<=|[+\-/*%~\[\](){}><=.:|,;]")
_CLOSE = {"[": "]", "(": ")", "{": "}"}


class Token:
    __slots__ = ("kind", "value", "pos")

    def __init__(self, kind, value, pos):
        self.kind, self.value, self.pos = kind, value, pos

    def __repr__(self):
        return f"Token({self.kind}, {self.value!r})"

    def describe(self):
        if self.kind in ("name", "op"):
            return repr(self.value)
        return {"eof": "end of template", "block_end": "end of statement block",
                "var_end": "end of print statement", "string": "string", "int": "integer",
                "float": "float", "data": "template data"}.get(self.kind, self.kind)


class Lexer:
    """Source -> tokens, with Jinja's whitespace rules (`-`/`+` markers, trim/lstrip blocks)."""

    def __init__(self, source, trim_blocks, lstrip_blocks):
        lines = _NEWLINES.split(source)
        if lines[-1] == "":
            del lines[-1]  # Jinja drops one trailing newline (keep_trailing_newline=False)
        self.source = "\n".join(lines)
        self.trim_blocks, self.lstrip_blocks = trim_blocks, lstrip_blocks
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", self.source)]

    def where(self, pos):
        line = bisect_right(self.line_starts, pos)
        return line, pos - self.line_starts[line - 1] + 1

    def fail(self, message, pos):
        raise JinjaSyntaxError(message, *self.where(pos))

    def tokenize(self):
        src, tokens, pos, line_starting = self.source, [], 0, True
        while pos < len(src):
            m = _TAG_START.search(src, pos)
            if m is None:
                tokens.append(Token("data", src[pos:], pos))
                break
            text, kind, sign = src[pos:m.start()], m.group(1), m.group(2)
            raw = _RAW_BEGIN.match(src, m.start()) if kind == "%" else None
            text = self._strip_before(text, sign, kind, line_starting)
            if text:
                tokens.append(Token("data", text, pos))
            if raw is not None:
                pos, line_starting = self._raw(raw, tokens)
            elif kind == "#":
                pos, line_starting = self._comment(m)
            else:
                pos, line_starting = self._tag(m, kind, tokens)
        tokens.append(Token("eof", None, len(src)))
        return tokens

    def _strip_before(self, text, sign, kind, line_starting):
        if sign == "-":
            return text.rstrip()
        if sign != "+" and self.lstrip_blocks and kind != "{":
            start = text.rfind("\n") + 1
            if (start > 0 or line_starting) and _WHITESPACE.fullmatch(text, start):
                return text[:start]
        return text

    def _end(self, src, pos, delim, trims):
        """Match an end delimiter (`-%}`, `+%}`, `%}`) at pos; returns (end, line_starting) or None."""
        if src.startswith("-" + delim, pos):
            end = _WHITESPACE.match(src, pos + 3)
            end = end.end() if end else pos + 3
        elif trims and src.startswith("+" + delim, pos):
            end = pos + 3
        elif src.startswith(delim, pos):
            end = pos + 2
            if trims and self.trim_blocks and src.startswith("\n", end):
                end += 1
        else:
            return None
        return end, src[end - 1] == "\n"

    def _comment(self, m):
        end = _COMMENT_END.search(self.source, m.end())
        if end is None:
            self.fail("missing end of comment tag", m.start())
        return self._end(self.source, end.start(), "#}", True)

    def _raw(self, m, tokens):
        src = self.source
        end = _RAW_END.search(src, m.end())
        if end is None:
            self.fail("missing end of raw directive", m.start())
        text = self._strip_before(src[m.end():end.start()], end.group(1), "%", m.group().endswith("\n"))
        if text:
            tokens.append(Token("data", text, m.end()))
        return self._end(src, end.end(), "%}", True)

    def _tag(self, m, kind, tokens):
        src, pos = self.source, m.end()
        delim, begin, finish = ("}}", "var_begin", "var_end") if kind == "{" \
            else ("%}", "block_begin", "block_end")
        tokens.append(Token(begin, None, m.start()))
        balance = []
        while True:
            if pos >= len(src):
                self.fail(f"unexpected end of template, expected {delim!r}", m.start())
            if not balance:
                end = self._end(src, pos, delim, kind == "%")
                if end is not None:
                    tokens.append(Token(finish, None, pos))
                    return end
            w = _WHITESPACE.match(src, pos)
            if w:
                pos = w.end()
                continue
            pos = self._expression_token(src, pos, tokens, balance)

    def _expression_token(self, src, pos, tokens, balance):
        m = _FLOAT.match(src, pos)
        if m:
            tokens.append(Token("float", float(m.group().replace("_", "")), pos))
            return m.end()
        m = _INTEGER.match(src, pos)
        if m:
            tokens.append(Token("int", int(m.group().replace("_", ""), 0), pos))
            return m.end()
        m = _NAME.match(src, pos)
        if m:
            tokens.append(Token("name", m.group(), pos))
            return m.end()
        m = _STRING.match(src, pos)
        if m:
            tokens.append(Token("string", self._unescape(m.group()[1:-1], pos), pos))
            return m.end()
        m = _OPERATOR.match(src, pos)
        if m:
            op = m.group()
            if op in _CLOSE:
                balance.append(_CLOSE[op])
            elif op in ")]}":
                if not balance:
                    self.fail(f"unexpected {op!r}", pos)
                expected = balance.pop()
                if op != expected:
                    self.fail(f"unexpected {op!r}, expected {expected!r}", pos)
            tokens.append(Token("op", op, pos))
            return m.end()
        self.fail(f"unexpected character {src[pos]!r}", pos)

    def _unescape(self, body, pos):
        # Python's own string escapes, as Jinja reads string literals.
        try:
            return body.encode("ascii", "backslashreplace").decode("unicode-escape")
        except UnicodeDecodeError as e:
            self.fail(f"invalid escape in string literal: {e.reason}", pos)


# ----------------------------------------------------------------------------- expression AST

class Expr:
    __slots__ = ("line",)


class Const(Expr):
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def eval(self, scope):
        return self.value


class Name(Expr):
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def eval(self, scope):
        return lookup(scope, self.name)


class ListExpr(Expr):
    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items

    def eval(self, scope):
        return [item.eval(scope) for item in self.items]


class TupleExpr(ListExpr):
    __slots__ = ()

    def eval(self, scope):
        return tuple(item.eval(scope) for item in self.items)


class DictExpr(Expr):
    __slots__ = ("pairs",)

    def __init__(self, pairs):
        self.pairs = pairs

    def eval(self, scope):
        return {k.eval(scope): v.eval(scope) for k, v in self.pairs}


class Getattr(Expr):
    __slots__ = ("obj", "name")

    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def eval(self, scope):
        obj = self.obj.eval(scope)
        if type(obj) is dict and self.name in obj and not hasattr(dict, self.name):
            return obj[self.name]
        return get_attribute(obj, self.name)


class Getitem(Expr):
    __slots__ = ("obj", "key")

    def __init__(self, obj, key):
        self.obj, self.key = obj, key

    def eval(self, scope):
        return get_item(self.obj.eval(scope), self.key.eval(scope))


class SliceExpr(Expr):
    __slots__ = ("start", "stop", "step")

    def __init__(self, start, stop, step):
        self.start, self.stop, self.step = start, stop, step

    def eval(self, scope):
        return slice(*(None if e is None else e.eval(scope) for e in (self.start, self.stop, self.step)))


class Sliced(Expr):
    """`obj[a:b:c]`: Python slicing, on sequences only (in Jinja slices bypass item lookup)."""
    __slots__ = ("obj", "slice")

    def __init__(self, obj, slice_expr):
        self.obj, self.slice = obj, slice_expr

    def eval(self, scope):
        obj = self.obj.eval(scope)
        if isinstance(obj, Undefined):
            obj.fail()
        if not isinstance(obj, (str, list, tuple, range)):
            raise TypeError(f"{type(obj).__name__!r} object is not subscriptable")
        return obj[self.slice.eval(scope)]


class Arguments:
    """Call arguments: positional, keyword, `*args`, `**kwargs`."""
    __slots__ = ("args", "kwargs", "star", "starstar")

    def __init__(self, args, kwargs, star, starstar):
        self.args, self.kwargs, self.star, self.starstar = args, kwargs, star, starstar

    def eval(self, scope):
        args = [a.eval(scope) for a in self.args]
        kwargs = {k: v.eval(scope) for k, v in self.kwargs}
        if self.star is not None:
            args.extend(self.star.eval(scope))
        if self.starstar is not None:
            kwargs.update(self.starstar.eval(scope))
        return args, kwargs


class Call(Expr):
    __slots__ = ("fn", "arguments")

    def __init__(self, fn, arguments):
        self.fn, self.arguments = fn, arguments

    def eval(self, scope, **extra):
        fn = self.fn.eval(scope)
        args, kwargs = self.arguments.eval(scope)
        kwargs.update(extra)
        return _call(fn, args, kwargs)


class FilterExpr(Expr):
    __slots__ = ("node", "fn", "arguments")

    def __init__(self, node, fn, arguments):
        self.node, self.fn, self.arguments = node, fn, arguments

    def eval(self, scope):
        return self.apply(self.node.eval(scope), scope)

    def apply(self, value, scope):
        args, kwargs = self.arguments.eval(scope)
        return self.fn(value, *args, **kwargs)


class TestExpr(Expr):
    __slots__ = ("node", "fn", "arguments")

    def __init__(self, node, fn, arguments):
        self.node, self.fn, self.arguments = node, fn, arguments

    def eval(self, scope):
        args, kwargs = self.arguments.eval(scope)
        return bool(self.fn(self.node.eval(scope), *args, **kwargs))


class Unary(Expr):
    __slots__ = ("op", "node")

    def __init__(self, op, node):
        self.op, self.node = op, node

    def eval(self, scope):
        value = self.node.eval(scope)
        if self.op == "not":
            return not value
        return -value if self.op == "-" else +value


_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": _multiply,
    "/": lambda a, b: a / b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "**": _power,
}


class Binary(Expr):
    __slots__ = ("fn", "left", "right")

    def __init__(self, op, left, right):
        self.fn, self.left, self.right = _BINARY[op], left, right

    def eval(self, scope):
        return self.fn(self.left.eval(scope), self.right.eval(scope))


class Concat(Expr):
    __slots__ = ("nodes",)

    def __init__(self, nodes):
        self.nodes = nodes

    def eval(self, scope):
        return "".join([to_str(n.eval(scope)) for n in self.nodes])


def _contains(container, item):
    if isinstance(container, Undefined):
        return False
    return item in container


_COMPARE = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "in": lambda a, b: _contains(b, a),
    "notin": lambda a, b: not _contains(b, a),
}


class Compare(Expr):
    __slots__ = ("first", "ops")

    def __init__(self, first, ops):
        self.first, self.ops = first, [(_COMPARE[op], node) for op, node in ops]

    def eval(self, scope):
        left = self.first.eval(scope)
        for fn, node in self.ops:
            right = node.eval(scope)
            if not fn(left, right):
                return False
            left = right
        return True


class And(Expr):
    __slots__ = ("left", "right")

    def __init__(self, left, right):
        self.left, self.right = left, right

    def eval(self, scope):
        return self.left.eval(scope) and self.right.eval(scope)


class Or(And):
    __slots__ = ()

    def eval(self, scope):
        return self.left.eval(scope) or self.right.eval(scope)


class CondExpr(Expr):
    __slots__ = ("test", "then", "otherwise")

    def __init__(self, test, then, otherwise):
        self.test, self.then, self.otherwise = test, then, otherwise

    def eval(self, scope):
        if self.test.eval(scope):
            return self.then.eval(scope)
        if self.otherwise is None:
            return Undefined("the inline if-expression evaluated to false and has no else section")
        return self.otherwise.eval(scope)


# ------------------------------------------------------------------------------ statement AST

class Scope:
    """Variables of one level: the template, one loop iteration, one macro call, a block."""
    __slots__ = ("vars", "parent")

    def __init__(self, vars, parent):
        self.vars, self.parent = vars, parent


class BreakLoop(Exception):
    pass


class ContinueLoop(Exception):
    pass


def _run(expr, scope):
    """Evaluate an expression of a statement, turning Python errors into a runtime error at its line."""
    try:
        return expr.eval(scope)
    except JinjaRuntimeError as e:
        raise e.at_line(expr.line) from None
    except TemplateError:
        raise
    except RecursionError:
        raise JinjaRuntimeError("the template recursed too deeply", expr.line) from None
    except Exception as e:
        raise JinjaRuntimeError(f"{type(e).__name__}: {e}", expr.line) from None


def _render(body, scope, out):
    for node in body:
        node.render(scope, out)


def lookup(scope, name):
    while scope is not None:
        if name in scope.vars:
            return scope.vars[name]
        scope = scope.parent
    return undefined_name(name)


def _assign(target, value, scope, line=None):
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
        _assign(name, v, scope, line)


class NSRef:
    """The target `ns.attr` of a set: assignable on namespace objects only."""
    __slots__ = ("name", "attr", "line")

    def __init__(self, name, attr, line):
        self.name, self.attr, self.line = name, attr, line

    def assign(self, value, scope):
        ns = lookup(scope, self.name)
        if not isinstance(ns, Namespace):
            raise JinjaRuntimeError("cannot assign attribute on non-namespace object", self.line)
        ns.attrs[self.attr] = value


class Data:
    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def render(self, scope, out):
        out.append(self.text)


class Output:
    __slots__ = ("expr",)

    def __init__(self, expr):
        self.expr = expr

    def render(self, scope, out):
        value = _run(self.expr, scope)
        out.append(value if type(value) is str else to_str(value))


class If:
    __slots__ = ("branches", "otherwise")

    def __init__(self, branches, otherwise):
        self.branches, self.otherwise = branches, otherwise

    def render(self, scope, out):
        for test, body in self.branches:
            if _run(test, scope):
                return _render(body, scope, out)
        _render(self.otherwise, scope, out)


class For:
    __slots__ = ("target", "iterable", "condition", "body", "otherwise", "line")

    def __init__(self, target, iterable, condition, body, otherwise, line):
        self.target, self.iterable, self.condition = target, iterable, condition
        self.body, self.otherwise, self.line = body, otherwise, line

    def render(self, scope, out):
        iterable = _run(self.iterable, scope)
        try:
            items = list(iterable)
        except TypeError as e:
            raise JinjaRuntimeError(f"TypeError: {e}", self.line) from None
        if self.condition is not None:
            kept = []
            for item in items:
                child = Scope({}, scope)
                _assign(self.target, item, child, self.line)
                if _run(self.condition, child):
                    kept.append(item)
            items = kept
        if not items:
            return _render(self.otherwise, Scope({}, scope), out)
        loop = Loop(items)
        for i, item in enumerate(items):
            loop.index0 = i
            child = Scope({"loop": loop}, scope)
            _assign(self.target, item, child, self.line)
            try:
                _render(self.body, child, out)
            except ContinueLoop:
                continue
            except BreakLoop:
                break


class LoopControl:
    __slots__ = ("signal",)

    def __init__(self, signal):
        self.signal = signal

    def render(self, scope, out):
        raise self.signal()


class Assign:
    __slots__ = ("target", "expr")

    def __init__(self, target, expr):
        self.target, self.expr = target, expr

    def render(self, scope, out):
        value = _run(self.expr, scope)
        if isinstance(self.target, NSRef):
            self.target.assign(value, scope)
        else:
            _assign(self.target, value, scope, self.expr.line)


class AssignBlock:
    """`{% set x %}...{% endset %}`, the rendered body through optional filters."""
    __slots__ = ("target", "filters", "body")

    def __init__(self, target, filters, body):
        self.target, self.filters, self.body = target, filters, body

    def render(self, scope, out):
        parts = []
        _render(self.body, Scope({}, scope), parts)
        value = "".join(parts)
        for f in self.filters:
            value = _run_filter(f, value, scope)
        if isinstance(self.target, NSRef):
            self.target.assign(value, scope)
        else:
            _assign(self.target, value, scope)


def _run_filter(f, value, scope):
    try:
        return f.apply(value, scope)
    except JinjaRuntimeError as e:
        raise e.at_line(f.line) from None
    except TemplateError:
        raise
    except Exception as e:
        raise JinjaRuntimeError(f"{type(e).__name__}: {e}", f.line) from None


class FilterBlock:
    __slots__ = ("filters", "body")

    def __init__(self, filters, body):
        self.filters, self.body = filters, body

    def render(self, scope, out):
        parts = []
        _render(self.body, Scope({}, scope), parts)
        value = "".join(parts)
        for f in self.filters:
            value = _run_filter(f, value, scope)
        out.append(to_str(value))


class With:
    __slots__ = ("targets", "values", "body")

    def __init__(self, targets, values, body):
        self.targets, self.values, self.body = targets, values, body

    def render(self, scope, out):
        child = Scope({}, scope)
        for target, value in zip(self.targets, self.values):
            _assign(target, _run(value, scope), child)
        _render(self.body, child, out)


class ScopeBlock:
    """A body rendered in its own scope (Hugging Face's `{% generation %}`)."""
    __slots__ = ("body",)

    def __init__(self, body):
        self.body = body

    def render(self, scope, out):
        _render(self.body, Scope({}, scope), out)


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
                local[name] = _run(self.defaults[i - first_default], scope)
            else:
                local[name] = Undefined(f"parameter {name!r} was not provided")
        local["varargs"] = tuple(args[len(self.params):])
        local["kwargs"] = kwargs
        if caller is not None:
            local["caller"] = caller
        out = []
        _render(self.body, scope, out)
        return "".join(out)

    def __repr__(self):
        return f"<Macro {self.name!r}>"


class MacroDef:
    __slots__ = ("name", "params", "defaults", "body")

    def __init__(self, name, params, defaults, body):
        self.name, self.params, self.defaults, self.body = name, params, defaults, body

    def render(self, scope, out):
        scope.vars[self.name] = Macro(self.name, self.params, self.defaults, self.body, scope)


class CallBlock:
    """`{% call(args) macro(...) %}body{% endcall %}`: the body becomes the macro's `caller`."""
    __slots__ = ("call", "params", "defaults", "body")

    def __init__(self, call, params, defaults, body):
        self.call, self.params, self.defaults, self.body = call, params, defaults, body

    def render(self, scope, out):
        caller = Macro("caller", self.params, self.defaults, self.body, scope)
        try:
            value = self.call.eval(scope, caller=caller)
        except JinjaRuntimeError as e:
            raise e.at_line(self.call.line) from None
        except TemplateError:
            raise
        except Exception as e:
            raise JinjaRuntimeError(f"{type(e).__name__}: {e}", self.call.line) from None
        out.append(to_str(value))


# ------------------------------------------------------------------------------------- parser

_UNSUPPORTED_TAGS = {
    "include": "including other templates", "import": "importing other templates",
    "from": "importing other templates", "extends": "template inheritance",
    "block": "template inheritance", "autoescape": "autoescaping",
    "do": "the 'do' statement (not enabled by Hugging Face)",
}
_COMPARE_OPS = ("==", "!=", "<", "<=", ">", ">=")


class Parser:
    """Tokens -> statement list, following Jinja's grammar and operator precedence."""

    def __init__(self, lexer):
        self.lexer = lexer
        self.tokens = lexer.tokenize()
        self.i = 0
        self.loop_depth = 0

    # token stream
    @property
    def current(self):
        return self.tokens[self.i]

    def look(self):
        return self.tokens[min(self.i + 1, len(self.tokens) - 1)]

    def advance(self):
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def fail(self, message, tok=None):
        self.lexer.fail(message, (tok or self.current).pos)

    def is_op(self, op):
        tok = self.current
        return tok.kind == "op" and tok.value == op

    def is_name(self, name):
        tok = self.current
        return tok.kind == "name" and tok.value == name

    def skip_op(self, op):
        if self.is_op(op):
            self.i += 1
            return True
        return False

    def skip_name(self, name):
        if self.is_name(name):
            self.i += 1
            return True
        return False

    def expect_op(self, op):
        if not self.is_op(op):
            self.fail(f"expected {op!r}, got {self.current.describe()}")
        return self.advance()

    def expect_name(self, name=None):
        tok = self.current
        if tok.kind != "name" or (name is not None and tok.value != name):
            self.fail(f"expected {repr(name) if name else 'a name'}, got {tok.describe()}")
        return self.advance()

    def expect_kind(self, kind):
        if self.current.kind != kind:
            self.fail(f"expected {Token(kind, None, 0).describe()}, got {self.current.describe()}")
        return self.advance()

    def line(self, tok):
        return self.lexer.where(tok.pos)[0]

    def node(self, expr, tok):
        expr.line = self.line(tok)
        return expr

    # statements
    def parse(self):
        body, _ = self.subparse(None)
        return body

    def subparse(self, end_names):
        body = []
        while True:
            tok = self.current
            if tok.kind == "data":
                body.append(Data(self.advance().value))
            elif tok.kind == "var_begin":
                self.advance()
                body.append(Output(self.parse_tuple()))
                self.expect_kind("var_end")
            elif tok.kind == "block_begin":
                self.advance()
                name = self.current
                if end_names is not None and name.kind == "name" and name.value in end_names:
                    return body, self.advance().value
                body.append(self.parse_statement())
                self.expect_kind("block_end")
            else:
                if end_names is not None:
                    wanted = " or ".join(repr(n) for n in end_names)
                    self.fail(f"unexpected end of template, expected {wanted}")
                return body, None

    def parse_body(self, *end_names):
        self.expect_kind("block_end")
        return self.subparse(end_names)

    def parse_statement(self):
        tok = self.current
        if tok.kind != "name":
            self.fail(f"expected a statement name, got {tok.describe()}")
        name = tok.value
        handler = getattr(self, f"parse_{name}", None) if name in (
            "for", "if", "set", "macro", "call", "filter", "with", "break", "continue",
            "generation") else None
        if handler is not None:
            self.advance()
            return handler(tok)
        if name in _UNSUPPORTED_TAGS:
            self.fail(f"{_UNSUPPORTED_TAGS[name]} ('{name}') is not supported in chat templates")
        self.fail(f"unknown tag {name!r}")

    def parse_for(self, tok):
        target = self.parse_assign_target(end_names=("in",))
        self.expect_name("in")
        iterable = self.parse_tuple(with_condexpr=False, end_names=("recursive",))
        condition = self.parse_expression() if self.skip_name("if") else None
        if self.is_name("recursive"):
            self.fail("recursive loops are not supported in chat templates")
        self.loop_depth += 1
        body, end = self.parse_body("endfor", "else")
        self.loop_depth -= 1
        otherwise = self.parse_body("endfor")[0] if end == "else" else []
        return For(target, iterable, condition, body, otherwise, self.line(tok))

    def parse_if(self, tok):
        branches, otherwise = [], []
        while True:
            test = self.parse_tuple(with_condexpr=False)
            body, end = self.parse_body("elif", "else", "endif")
            branches.append((test, body))
            if end == "elif":
                continue
            if end == "else":
                otherwise = self.parse_body("endif")[0]
            return If(branches, otherwise)

    def parse_set(self, tok):
        if self.current.kind == "name" and self.look().kind == "op" and self.look().value == ".":
            name = self.advance().value
            self.advance()
            target = NSRef(name, self.expect_name().value, self.line(tok))
        else:
            target = self.parse_assign_target()
        if self.skip_op("="):
            return Assign(target, self.parse_tuple())
        filters = self.parse_filters() if self.is_op("|") else []
        body, _ = self.parse_body("endset")
        return AssignBlock(target, filters, body)

    def parse_macro(self, tok):
        name = self.expect_name().value
        params, defaults = self.parse_signature()
        depth, self.loop_depth = self.loop_depth, 0
        body, _ = self.parse_body("endmacro")
        self.loop_depth = depth
        return MacroDef(name, params, defaults, body)

    def parse_signature(self):
        params, defaults = [], []
        self.expect_op("(")
        while not self.is_op(")"):
            if params:
                self.expect_op(",")
            params.append(self.expect_name().value)
            if self.skip_op("="):
                defaults.append(self.parse_expression())
            elif defaults:
                self.fail("non-default argument follows default argument")
        self.expect_op(")")
        return params, defaults

    def parse_call(self, tok):
        params, defaults = self.parse_signature() if self.is_op("(") else ([], [])
        call = self.parse_expression()
        if not isinstance(call, Call):
            self.fail("expected a call after 'call'", tok)
        depth, self.loop_depth = self.loop_depth, 0
        body, _ = self.parse_body("endcall")
        self.loop_depth = depth
        return CallBlock(call, params, defaults, body)

    def parse_filter(self, tok):
        filters = self.parse_filters(start_inline=True)
        body, _ = self.parse_body("endfilter")
        return FilterBlock(filters, body)

    def parse_with(self, tok):
        targets, values = [], []
        while self.current.kind != "block_end":
            if targets:
                self.expect_op(",")
            targets.append(self.parse_assign_target())
            self.expect_op("=")
            values.append(self.parse_expression())
        body, _ = self.parse_body("endwith")
        return With(targets, values, body)

    def parse_generation(self, tok):
        return ScopeBlock(self.parse_body("endgeneration")[0])

    def parse_break(self, tok):
        if not self.loop_depth:
            self.fail("'break' outside loop", tok)
        return LoopControl(BreakLoop)

    def parse_continue(self, tok):
        if not self.loop_depth:
            self.fail("'continue' outside loop", tok)
        return LoopControl(ContinueLoop)

    def parse_assign_target(self, end_names=()):
        """A name or a tuple of names: the targets of set, for and with."""
        targets, is_tuple = [], False
        while True:
            if targets:
                self.expect_op(",")
            if self.current.kind in ("block_end", "var_end") or self.is_op(")") or \
                    (self.current.kind == "name" and self.current.value in end_names):
                break
            if self.skip_op("("):
                targets.append(self.parse_assign_target())
                self.expect_op(")")
            else:
                tok = self.expect_name()
                if tok.value in ("true", "false", "none", "True", "False", "None"):
                    self.fail(f"cannot assign to {tok.value!r}", tok)
                targets.append(tok.value)
            if self.is_op(","):
                is_tuple = True
            else:
                break
        if not targets:
            self.fail(f"expected a name, got {self.current.describe()}")
        return tuple(targets) if is_tuple else targets[0]

    # expressions
    def parse_tuple(self, with_condexpr=True, end_names=(), explicit_parentheses=False):
        tok = self.current
        items, is_tuple = [], False
        while True:
            if items:
                self.expect_op(",")
            cur = self.current
            if cur.kind in ("var_end", "block_end") or self.is_op(")") or \
                    (cur.kind == "name" and cur.value in end_names):
                break
            items.append(self.parse_expression() if with_condexpr else self.parse_or())
            if self.is_op(","):
                is_tuple = True
            else:
                break
        if not is_tuple:
            if items:
                return items[0]
            if not explicit_parentheses:
                self.fail(f"expected an expression, got {self.current.describe()}")
        return self.node(TupleExpr(items), tok)

    def parse_expression(self, with_condexpr=True):
        return self.parse_condexpr() if with_condexpr else self.parse_or()

    def parse_condexpr(self):
        tok = self.current
        expr = self.parse_or()
        while self.skip_name("if"):
            test = self.parse_or()
            otherwise = self.parse_condexpr() if self.skip_name("else") else None
            expr = self.node(CondExpr(test, expr, otherwise), tok)
        return expr

    def parse_or(self):
        tok = self.current
        left = self.parse_and()
        while self.skip_name("or"):
            left = self.node(Or(left, self.parse_and()), tok)
        return left

    def parse_and(self):
        tok = self.current
        left = self.parse_not()
        while self.skip_name("and"):
            left = self.node(And(left, self.parse_not()), tok)
        return left

    def parse_not(self):
        tok = self.current
        if self.skip_name("not"):
            return self.node(Unary("not", self.parse_not()), tok)
        return self.parse_compare()

    def parse_compare(self):
        tok = self.current
        expr = self.parse_math1()
        ops = []
        while True:
            cur = self.current
            if cur.kind == "op" and cur.value in _COMPARE_OPS:
                self.advance()
                ops.append((cur.value, self.parse_math1()))
            elif self.skip_name("in"):
                ops.append(("in", self.parse_math1()))
            elif self.is_name("not") and self.look().kind == "name" and self.look().value == "in":
                self.i += 2
                ops.append(("notin", self.parse_math1()))
            else:
                break
        return self.node(Compare(expr, ops), tok) if ops else expr

    def parse_math1(self):
        tok = self.current
        left = self.parse_concat()
        while self.current.kind == "op" and self.current.value in ("+", "-"):
            op = self.advance().value
            left = self.node(Binary(op, left, self.parse_concat()), tok)
        return left

    def parse_concat(self):
        tok = self.current
        nodes = [self.parse_math2()]
        while self.skip_op("~"):
            nodes.append(self.parse_math2())
        return self.node(Concat(nodes), tok) if len(nodes) > 1 else nodes[0]

    def parse_math2(self):
        tok = self.current
        left = self.parse_pow()
        while self.current.kind == "op" and self.current.value in ("*", "/", "//", "%"):
            op = self.advance().value
            left = self.node(Binary(op, left, self.parse_pow()), tok)
        return left

    def parse_pow(self):
        tok = self.current
        left = self.parse_unary()
        while self.skip_op("**"):
            left = self.node(Binary("**", left, self.parse_unary()), tok)
        return left

    def parse_unary(self, with_filter=True):
        tok = self.current
        if self.is_op("-") or self.is_op("+"):
            self.advance()
            node = self.node(Unary(tok.value, self.parse_unary(False)), tok)
        else:
            node = self.parse_primary()
        node = self.parse_postfix(node)
        return self.parse_filter_expr(node) if with_filter else node

    def parse_primary(self):
        tok = self.current
        if tok.kind == "name":
            self.advance()
            if tok.value in ("true", "True"):
                return self.node(Const(True), tok)
            if tok.value in ("false", "False"):
                return self.node(Const(False), tok)
            if tok.value in ("none", "None"):
                return self.node(Const(None), tok)
            return self.node(Name(tok.value), tok)
        if tok.kind == "string":
            parts = []
            while self.current.kind == "string":
                parts.append(self.advance().value)
            return self.node(Const("".join(parts)), tok)
        if tok.kind in ("int", "float"):
            self.advance()
            return self.node(Const(tok.value), tok)
        if self.skip_op("("):
            node = self.parse_tuple(explicit_parentheses=True)
            self.expect_op(")")
            return node
        if self.skip_op("["):
            items = []
            while not self.is_op("]"):
                if items:
                    self.expect_op(",")
                if self.is_op("]"):
                    break
                items.append(self.parse_expression())
            self.expect_op("]")
            return self.node(ListExpr(items), tok)
        if self.skip_op("{"):
            pairs = []
            while not self.is_op("}"):
                if pairs:
                    self.expect_op(",")
                if self.is_op("}"):
                    break
                key = self.parse_expression()
                self.expect_op(":")
                pairs.append((key, self.parse_expression()))
            self.expect_op("}")
            return self.node(DictExpr(pairs), tok)
        self.fail(f"unexpected {tok.describe()}")

    def parse_postfix(self, node):
        while True:
            tok = self.current
            if self.skip_op("."):
                attr = self.advance()
                if attr.kind == "name":
                    node = self.node(Getattr(node, attr.value), tok)
                elif attr.kind == "int":
                    node = self.node(Getitem(node, self.node(Const(attr.value), attr)), tok)
                else:
                    self.fail("expected a name or a number after '.'", attr)
            elif self.skip_op("["):
                keys = []
                while not self.is_op("]"):
                    if keys:
                        self.expect_op(",")
                    keys.append(self.parse_subscribed())
                self.expect_op("]")
                if len(keys) == 1 and isinstance(keys[0], SliceExpr):
                    node = self.node(Sliced(node, keys[0]), tok)
                else:
                    key = keys[0] if len(keys) == 1 else self.node(TupleExpr(keys), tok)
                    node = self.node(Getitem(node, key), tok)
            elif self.is_op("("):
                node = self.node(Call(node, self.parse_call_args()), tok)
            else:
                return node

    def parse_subscribed(self):
        tok = self.current
        if self.skip_op(":"):
            parts = [None]
        else:
            node = self.parse_expression()
            if not self.skip_op(":"):
                return node
            parts = [node]
        if self.is_op(":") or self.is_op("]") or self.is_op(","):
            parts.append(None)
        else:
            parts.append(self.parse_expression())
        if self.skip_op(":"):
            parts.append(None if self.is_op("]") or self.is_op(",") else self.parse_expression())
        else:
            parts.append(None)
        return self.node(SliceExpr(*parts), tok)

    def parse_call_args(self):
        tok = self.expect_op("(")
        args, kwargs, star, starstar = [], [], None, None
        while not self.is_op(")"):
            if args or kwargs or star or starstar:
                self.expect_op(",")
                if self.is_op(")"):
                    break
            if self.skip_op("*"):
                if star is not None or starstar is not None:
                    self.fail("invalid syntax for function call expression", tok)
                star = self.parse_expression()
            elif self.skip_op("**"):
                if starstar is not None:
                    self.fail("invalid syntax for function call expression", tok)
                starstar = self.parse_expression()
            elif self.current.kind == "name" and self.look().kind == "op" and self.look().value == "=":
                if starstar is not None:
                    self.fail("invalid syntax for function call expression", tok)
                key = self.advance().value
                self.advance()
                kwargs.append((key, self.parse_expression()))
            else:
                if kwargs or star is not None or starstar is not None:
                    self.fail("positional argument follows keyword argument", tok)
                args.append(self.parse_expression())
        self.expect_op(")")
        return Arguments(args, kwargs, star, starstar)

    def parse_filter_expr(self, node):
        while True:
            if self.is_op("|"):
                node = self.parse_filters(node)
            elif self.is_name("is"):
                node = self.parse_test(node)
            elif self.is_op("("):
                tok = self.current
                node = self.node(Call(node, self.parse_call_args()), tok)
            else:
                return node

    def parse_filters(self, node=None, start_inline=False):
        """`| f(args) | g`; with node None, the filters of a block (a list, applied in order)."""
        block = node is None
        filters = []
        while self.is_op("|") or start_inline:
            if not start_inline:
                self.advance()
            start_inline = False
            tok = self.expect_name()
            if tok.value not in FILTERS:
                self.fail(f"no filter named {tok.value!r}", tok)
            arguments = self.parse_call_args() if self.is_op("(") else Arguments([], [], None, None)
            node = self.node(FilterExpr(node, FILTERS[tok.value], arguments), tok)
            filters.append(node)
        return filters if block else node

    def parse_test(self, node):
        tok = self.advance()
        negated = self.skip_name("not")
        name_tok = self.expect_name()
        name = name_tok.value
        if name not in TESTS:
            self.fail(f"no test named {name!r}", name_tok)
        cur = self.current
        if self.is_op("("):
            arguments = self.parse_call_args()
        elif (cur.kind in ("name", "string", "int", "float") or self.is_op("(") or self.is_op("[")
              or self.is_op("{")) and not (cur.kind == "name" and cur.value in ("else", "or", "and")):
            if cur.kind == "name" and cur.value == "is":
                self.fail("You cannot chain multiple tests with is")
            arg = self.parse_postfix(self.parse_primary())
            arguments = Arguments([arg], [], None, None)
        else:
            arguments = Arguments([], [], None, None)
        node = self.node(TestExpr(node, TESTS[name], arguments), tok)
        return self.node(Unary("not", node), tok) if negated else node


# ----------------------------------------------------------------------------------- template

def _raise_exception(message):
    raise RaisedByTemplate(str(message))


def _range(*args):
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise JinjaSecurityError(f"range too big: the sandbox allows {MAX_RANGE} items")
    return rng


GLOBALS = {
    "range": Function("range", _range),
    "dict": Function("dict", lambda *args, **kwargs: dict(*args, **kwargs)),
    "namespace": Function("namespace", Namespace),
    "raise_exception": Function("raise_exception", _raise_exception),
    "strftime_now": Function("strftime_now", lambda fmt: clock().strftime(fmt)),
}


class Template:
    """A compiled template: parse once, render many times with different variables."""

    def __init__(self, source, *, trim_blocks=True, lstrip_blocks=True):
        if not isinstance(source, str):
            raise JinjaSyntaxError(f"template source must be a string, not {type(source).__name__}")
        self.body = Parser(Lexer(source, trim_blocks, lstrip_blocks)).parse()

    def render(self, **context):
        scope = Scope({}, Scope(context, Scope(GLOBALS, None)))
        out = []
        try:
            _render(self.body, scope, out)
        except (BreakLoop, ContinueLoop):
            raise JinjaRuntimeError("'break' or 'continue' outside a loop") from None
        return "".join(out)
