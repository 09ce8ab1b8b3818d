"""Template source -> tokens: the data between tags, and inside `{{ }}`/`{% %}` the names,
literals and operators, with Jinja's whitespace rules (`-`/`+` markers, trim and lstrip blocks).
Comments and raw blocks end here; nothing is parsed."""
import re
from bisect import bisect_right

from .runtime import JinjaSyntaxError

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

