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

The package, in the order a template goes through it: lexer.py (source -> tokens), parser.py
(tokens -> nodes.py's tree), runtime.py (values, the sandbox, scopes) and filters.py (the
built-in filters and tests); this module holds the globals and `Template`.
"""
import datetime

from .lexer import Lexer
from .parser import Parser
from .runtime import (BreakLoop, ContinueLoop, Function, JinjaRuntimeError, JinjaSecurityError,
                      JinjaSyntaxError, Namespace, RaisedByTemplate, Scope, render_body)

__all__ = ["Template", "JinjaSyntaxError", "JinjaRuntimeError", "JinjaSecurityError",
           "RaisedByTemplate"]

MAX_RANGE = 100_000            # as Jinja's sandbox: range() longer than this is refused

clock = datetime.datetime.now  # what strftime_now reads; tests replace it with a fixed time


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
            render_body(self.body, scope, out)
        except (BreakLoop, ContinueLoop):
            raise JinjaRuntimeError("'break' or 'continue' outside a loop") from None
        return "".join(out)
