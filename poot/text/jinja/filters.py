"""Jinja's built-in filters (`x|name(...)`) and tests (`x is name`), as the sandbox offers
them: by name in `FILTERS` and `TESTS`, each a plain function of the value and its arguments."""
import json
import math
import re

from .runtime import (JinjaRuntimeError, Markup, Undefined, check_size, escape, get_attribute,
                      get_item, to_str, undefined_attribute)

# ------------------------------------------------------------------------------------ filters

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
    return "".join(p[0].upper() + p[1:].lower() for p in _WORD_BEGINNING.split(to_str(s)) if p)


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
        check_size(width)
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
    check_size(width)
    return to_str(value).center(width)


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
    return to_str(value) % (kwargs or args)


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
    "capitalize": lambda s: to_str(s).capitalize(),
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
    "lower": lambda s: to_str(s).lower(),
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
    "string": to_str,
    "sum": f_sum,
    "title": f_title,
    "tojson": f_tojson,
    "trim": lambda value, chars=None: to_str(value).strip(chars),
    "unique": f_unique,
    "upper": lambda s: to_str(s).upper(),
    "wordcount": lambda s: len(re.findall(r"\w+", to_str(s))),
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


# The comparison tests, under every name Jinja gives each.
_COMPARISONS = {"eq equalto ==": lambda a, b: a == b, "ne !=": lambda a, b: a != b,
                "lt lessthan <": lambda a, b: a < b, "le <=": lambda a, b: a <= b,
                "gt greaterthan >": lambda a, b: a > b, "ge >=": lambda a, b: a >= b}

TESTS = {
    **{name: test for names, test in _COMPARISONS.items() for name in names.split()},
    "boolean": lambda v: v is True or v is False,
    "callable": callable,
    "defined": lambda v: not isinstance(v, Undefined),
    "divisibleby": lambda v, num: v % num == 0,
    "escaped": lambda v: isinstance(v, Markup),
    "even": lambda v: v % 2 == 0,
    "false": lambda v: v is False,
    "filter": lambda v: v in FILTERS,
    "float": lambda v: isinstance(v, float),
    "in": lambda v, seq: v in seq,
    "integer": lambda v: isinstance(v, int) and v is not True and v is not False,
    "iterable": _is_iterable,
    "lower": lambda v: str(v).islower(),
    "mapping": lambda v: isinstance(v, dict),
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

