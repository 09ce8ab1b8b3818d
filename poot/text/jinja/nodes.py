"""The template's syntax tree: expressions (`eval(scope)` -> value) and statements
(`render(scope, out)` appends text). The parser builds them; evaluating them goes through the
sandbox's rules in runtime.py, never around them."""
from poot.errors import TemplateError

from .runtime import (BreakLoop, ContinueLoop, JinjaRuntimeError, Loop, Macro, Namespace, Scope,
                      Undefined, bind, call, evaluate, get_attribute, get_item, lookup, multiply,
                      power, render_body, to_str)

# ----------------------------------------------------------------------------- expression AST

class Node:
    """A node of the tree, made from its fields in the order its class's `__slots__` names them
    (a class that adds no slots takes its parent's)."""
    __slots__ = ()

    def __init__(self, *values):
        fields = next(c.__slots__ for c in type(self).__mro__ if c.__dict__.get("__slots__"))
        for field, value in zip(fields, values, strict=True):
            setattr(self, field, value)


class Expr(Node):
    __slots__ = ("line",)     # set by the parser


class Const(Expr):
    __slots__ = ("value",)

    def eval(self, scope):
        return self.value


class Name(Expr):
    __slots__ = ("name",)

    def eval(self, scope):
        return lookup(scope, self.name)


class ListExpr(Expr):
    __slots__ = ("items",)

    def eval(self, scope):
        return [item.eval(scope) for item in self.items]


class TupleExpr(ListExpr):
    __slots__ = ()

    def eval(self, scope):
        return tuple(item.eval(scope) for item in self.items)


class DictExpr(Expr):
    __slots__ = ("pairs",)

    def eval(self, scope):
        return {k.eval(scope): v.eval(scope) for k, v in self.pairs}


class Getattr(Expr):
    __slots__ = ("obj", "name")

    def eval(self, scope):
        obj = self.obj.eval(scope)
        if type(obj) is dict and self.name in obj and not hasattr(dict, self.name):
            return obj[self.name]
        return get_attribute(obj, self.name)


class Getitem(Expr):
    __slots__ = ("obj", "key")

    def eval(self, scope):
        return get_item(self.obj.eval(scope), self.key.eval(scope))


class SliceExpr(Expr):
    __slots__ = ("start", "stop", "step")

    def eval(self, scope):
        return slice(*(None if e is None else e.eval(scope) for e in (self.start, self.stop, self.step)))


class Sliced(Expr):
    """`obj[a:b:c]`: Python slicing, on sequences only (in Jinja slices bypass item lookup)."""
    __slots__ = ("obj", "slice")

    def eval(self, scope):
        obj = self.obj.eval(scope)
        if isinstance(obj, Undefined):
            obj.fail()
        if not isinstance(obj, (str, list, tuple, range)):
            raise TypeError(f"{type(obj).__name__!r} object is not subscriptable")
        return obj[self.slice.eval(scope)]


class Arguments(Node):
    """Call arguments: positional, keyword, `*args`, `**kwargs`."""
    __slots__ = ("args", "kwargs", "star", "starstar")

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

    def eval(self, scope, **extra):
        fn = self.fn.eval(scope)
        args, kwargs = self.arguments.eval(scope)
        kwargs.update(extra)
        return call(fn, args, kwargs)


class FilterExpr(Expr):
    __slots__ = ("node", "fn", "arguments")

    def eval(self, scope):
        return self.apply(self.node.eval(scope), scope)

    def apply(self, value, scope):
        args, kwargs = self.arguments.eval(scope)
        return self.fn(value, *args, **kwargs)


class TestExpr(Expr):
    __slots__ = ("node", "fn", "arguments")

    def eval(self, scope):
        args, kwargs = self.arguments.eval(scope)
        return bool(self.fn(self.node.eval(scope), *args, **kwargs))


class Unary(Expr):
    __slots__ = ("op", "node")

    def eval(self, scope):
        value = self.node.eval(scope)
        if self.op == "not":
            return not value
        return -value if self.op == "-" else +value


_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": multiply,
    "/": lambda a, b: a / b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "**": power,
}


class Binary(Expr):
    __slots__ = ("fn", "left", "right")

    def __init__(self, op, left, right):
        self.fn, self.left, self.right = _BINARY[op], left, right

    def eval(self, scope):
        return self.fn(self.left.eval(scope), self.right.eval(scope))


class Concat(Expr):
    __slots__ = ("nodes",)

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

    def eval(self, scope):
        return self.left.eval(scope) and self.right.eval(scope)


class Or(And):
    __slots__ = ()

    def eval(self, scope):
        return self.left.eval(scope) or self.right.eval(scope)


class CondExpr(Expr):
    __slots__ = ("test", "then", "otherwise")

    def eval(self, scope):
        if self.test.eval(scope):
            return self.then.eval(scope)
        if self.otherwise is None:
            return Undefined("the inline if-expression evaluated to false and has no else section")
        return self.otherwise.eval(scope)


# ------------------------------------------------------------------------------ statement AST

class NSRef(Node):
    """The target `ns.attr` of a set: assignable on namespace objects only."""
    __slots__ = ("name", "attr", "line")

    def assign(self, value, scope):
        ns = lookup(scope, self.name)
        if not isinstance(ns, Namespace):
            raise JinjaRuntimeError("cannot assign attribute on non-namespace object", self.line)
        ns.attrs[self.attr] = value


class Data(Node):
    __slots__ = ("text",)

    def render(self, scope, out):
        out.append(self.text)


class Output(Node):
    __slots__ = ("expr",)

    def render(self, scope, out):
        value = evaluate(self.expr, scope)
        out.append(value if type(value) is str else to_str(value))


class If(Node):
    __slots__ = ("branches", "otherwise")

    def render(self, scope, out):
        for test, body in self.branches:
            if evaluate(test, scope):
                return render_body(body, scope, out)
        render_body(self.otherwise, scope, out)


class For(Node):
    __slots__ = ("target", "iterable", "condition", "body", "otherwise", "line")

    def render(self, scope, out):
        iterable = evaluate(self.iterable, scope)
        try:
            items = list(iterable)
        except TypeError as e:
            raise JinjaRuntimeError(f"TypeError: {e}", self.line) from None
        if self.condition is not None:
            kept = []
            for item in items:
                child = Scope({}, scope)
                bind(self.target, item, child, self.line)
                if evaluate(self.condition, child):
                    kept.append(item)
            items = kept
        if not items:
            return render_body(self.otherwise, Scope({}, scope), out)
        loop = Loop(items)
        for i, item in enumerate(items):
            loop.index0 = i
            child = Scope({"loop": loop}, scope)
            bind(self.target, item, child, self.line)
            try:
                render_body(self.body, child, out)
            except ContinueLoop:
                continue
            except BreakLoop:
                break


class LoopControl(Node):
    __slots__ = ("signal",)

    def render(self, scope, out):
        raise self.signal()


class Assign(Node):
    __slots__ = ("target", "expr")

    def render(self, scope, out):
        value = evaluate(self.expr, scope)
        if isinstance(self.target, NSRef):
            self.target.assign(value, scope)
        else:
            bind(self.target, value, scope, self.expr.line)


def _filtered(body, filters, scope):
    """A block's body rendered in a scope of its own, then through `filters` in order."""
    parts = []
    render_body(body, Scope({}, scope), parts)
    value = "".join(parts)
    for f in filters:
        try:
            value = f.apply(value, scope)
        except JinjaRuntimeError as e:
            raise e.at_line(f.line) from None
        except TemplateError:
            raise
        except Exception as e:
            raise JinjaRuntimeError(f"{type(e).__name__}: {e}", f.line) from None
    return value


class AssignBlock(Node):
    """`{% set x %}...{% endset %}`, the rendered body through optional filters."""
    __slots__ = ("target", "filters", "body")

    def render(self, scope, out):
        value = _filtered(self.body, self.filters, scope)
        if isinstance(self.target, NSRef):
            self.target.assign(value, scope)
        else:
            bind(self.target, value, scope)


class FilterBlock(Node):
    __slots__ = ("filters", "body")

    def render(self, scope, out):
        out.append(to_str(_filtered(self.body, self.filters, scope)))


class With(Node):
    __slots__ = ("targets", "values", "body")

    def render(self, scope, out):
        child = Scope({}, scope)
        for target, value in zip(self.targets, self.values):
            bind(target, evaluate(value, scope), child)
        render_body(self.body, child, out)


class ScopeBlock(Node):
    """A body rendered in its own scope (Hugging Face's `{% generation %}`)."""
    __slots__ = ("body",)

    def render(self, scope, out):
        render_body(self.body, Scope({}, scope), out)


class MacroDef(Node):
    __slots__ = ("name", "params", "defaults", "body")

    def render(self, scope, out):
        scope.vars[self.name] = Macro(self.name, self.params, self.defaults, self.body, scope)


class CallBlock(Node):
    """`{% call(args) macro(...) %}body{% endcall %}`: the body becomes the macro's `caller`."""
    __slots__ = ("call", "params", "defaults", "body")

    def render(self, scope, out):
        caller = Macro("caller", self.params, self.defaults, self.body, scope)
        out.append(to_str(evaluate(self.call, scope, caller=caller)))
