"""Tokens -> the syntax tree of nodes.py, following Jinja's grammar and operator precedence;
filters and tests are looked up by name here, so an unknown one is a syntax error with its line."""
from .filters import FILTERS, TESTS
from .lexer import Token
from .nodes import (And, Arguments, Assign, AssignBlock, Binary, Call, CallBlock, Compare,
                    Concat, CondExpr, Const, Data, DictExpr, FilterBlock, FilterExpr, For, Getattr,
                    Getitem, If, ListExpr, LoopControl, MacroDef, Name, NSRef, Or, Output,
                    ScopeBlock, SliceExpr, Sliced, TestExpr, TupleExpr, Unary, With)
from .runtime import BreakLoop, ContinueLoop

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
        return self.parse_chain("or", Or, self.parse_and)

    def parse_and(self):
        return self.parse_chain("and", And, self.parse_not)

    def parse_chain(self, word, node, operand):
        """`a word b word c ...`, left to right."""
        tok = self.current
        left = operand()
        while self.skip_name(word):
            left = self.node(node(left, operand()), tok)
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
            return self.node(ListExpr(self.parse_items("]", self.parse_expression)), tok)
        if self.skip_op("{"):
            return self.node(DictExpr(self.parse_items("}", self.parse_pair)), tok)
        self.fail(f"unexpected {tok.describe()}")

    def parse_items(self, close, item):
        """`item, item, ...` up to the `close` operator (a trailing comma allowed)."""
        items = []
        while not self.is_op(close):
            if items:
                self.expect_op(",")
            if self.is_op(close):
                break
            items.append(item())
        self.expect_op(close)
        return items

    def parse_pair(self):
        key = self.parse_expression()
        self.expect_op(":")
        return key, self.parse_expression()

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

