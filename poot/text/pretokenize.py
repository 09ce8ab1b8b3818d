"""Pre-tokenizers: how a text segment is cut into the words that BPE then encodes one at a time.

The splitting rules are the regex patterns published in the models' `tokenizer.json` files (GPT-2,
Llama 3, Qwen2) and the digit splitting of SmolLM2/StarCoder. Each published pattern is translated
once into a stdlib `re` pattern: `\\p{L}`, `\\p{N}` and `\\s` become explicit character classes
built from `unicodedata` (general categories L* and N*, the White_Space property), so matching
runs in C with exactly the published semantics. A pattern not in `PATTERNS` is refused rather than
run under a different regex dialect. Not here: BPE (bpe.py), special tokens (tokenizer.py).
"""

import functools
import re
import sys
import unicodedata

from poot.errors import PootError


class TokenizerUnsupported(PootError):
    """A tokenizer file asks for a model, pre-tokenizer or option poot does not implement."""
    exit_status = 7

    def __init__(self, what, name, supported=()):
        self.what, self.name, self.supported = what, name, tuple(supported)
        message = f"unsupported tokenizer {what} {name!r}"
        if self.supported:
            message += f" (supported: {', '.join(self.supported)})"
        super().__init__(message)


# The split patterns exactly as they are spelled in the published tokenizer.json files.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PATTERNS = {"gpt2": GPT2, "llama3": LLAMA3, "qwen2": QWEN2}

# The Unicode White_Space property (PropList.txt), which is what `\s` means in the published
# patterns; str.isspace() differs (it also counts U+001C..U+001F).
WHITE_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
               (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
               (0x3000, 0x3000)]


@functools.cache
def _category_ranges():
    """{'L': [(lo, hi), ...], 'N': [...]} over all code points, from this Python's unicodedata."""
    ranges = {"L": [], "N": []}
    category = unicodedata.category
    open_major, start = None, 0
    for cp in range(sys.maxunicode + 1):
        major = category(chr(cp))[0]
        if major != open_major:
            if open_major in ranges:
                ranges[open_major].append((start, cp - 1))
            open_major, start = major, cp
    if open_major in ranges:
        ranges[open_major].append((start, sys.maxunicode))
    return ranges


def _class_body(ranges):
    return "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)


@functools.cache
def _escapes():
    ranges = _category_ranges()
    return {"p{L}": _class_body(ranges["L"]), "p{N}": _class_body(ranges["N"]),
            "s": _class_body(WHITE_SPACE)}


def translate(pattern):
    """A published (Oniguruma-dialect) split pattern as an equivalent stdlib `re` pattern."""
    classes, out, i, in_class = _escapes(), [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            escape = next((e for e in ("p{L}", "p{N}", "s", "S") if pattern.startswith(e, i + 1)),
                          None)
            if escape is None:
                out.append(pattern[i:i + 2])
                i += 2
                continue
            if escape == "S":
                if in_class:
                    raise TokenizerUnsupported("split pattern", pattern)
                out.append(f"[^{classes['s']}]")
            else:
                out.append(classes[escape] if in_class else f"[{classes[escape]}]")
            i += 1 + len(escape)
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


@functools.cache
def compiled(name):
    return re.compile(translate(PATTERNS[name]))


@functools.cache
def _digits(individual):
    n = _escapes()["p{N}"]
    return re.compile(f"[{n}]" if individual else f"[{n}]+")


def _isolate(regex, piece):
    """Split `piece` at the matches of `regex`, keeping matches and the text between them."""
    out, at = [], 0
    for m in regex.finditer(piece):
        if m.start() > at:
            out.append(piece[at:m.start()])
        if m.end() > m.start():
            out.append(m.group())
        at = m.end()
    if at < len(piece):
        out.append(piece[at:])
    return out


class PreTokenizer:
    """Normalization plus a sequence of splitting steps, each applied to every piece so far.

    `steps` holds ("regex", name) or ("digits", individual) entries; `normal_form` is a
    unicodedata form such as "NFC" or None; `prefix_space` prepends a space to each segment that
    does not already start with one (ByteLevel's add_prefix_space).
    """

    def __init__(self, steps, normal_form=None, prefix_space=False):
        self.steps = tuple(steps)
        self.normal_form = normal_form
        self.prefix_space = prefix_space
        self._regexes = [compiled(arg) if kind == "regex" else _digits(arg)
                         for kind, arg in self.steps]

    def __repr__(self):
        return f"PreTokenizer({self.steps!r}, normal_form={self.normal_form!r})"

    def normalize(self, text):
        if self.normal_form:
            text = unicodedata.normalize(self.normal_form, text)
        if self.prefix_space and text and not text.startswith(" "):
            text = " " + text
        return text

    def words(self, text, first=True):
        """The words of one text segment (`first` is unused: byte-level treats all alike)."""
        return self.split(self.normalize(text))

    def split(self, text):
        pieces = [text] if text else []
        for (kind, _), regex in zip(self.steps, self._regexes):
            # Every character matches some alternative of a published pattern, so findall loses
            # nothing; digit splitting keeps the text between the digits.
            cut = regex.findall if kind == "regex" else functools.partial(_isolate, regex)
            pieces = [p for piece in pieces for p in cut(piece)]
        return pieces


# tokenizer.ggml.pre names -> the pre-tokenizer the model was trained with. "default" is what the
# converter writes for GPT-2-style vocabularies it does not otherwise name.
GGUF_PRE = {
    "default": ([("regex", "gpt2")], None),
    "gpt2": ([("regex", "gpt2")], None),
    "gpt-2": ([("regex", "gpt2")], None),
    "llama-bpe": ([("regex", "llama3")], None),
    "llama3": ([("regex", "llama3")], None),
    "llama-v3": ([("regex", "llama3")], None),
    # Qwen2's tokenizer.json normalizes to NFC before splitting; the GGUF has no key for it.
    "qwen2": ([("regex", "qwen2")], "NFC"),
    "smollm": ([("digits", True), ("regex", "gpt2")], None),
    "starcoder": ([("digits", True), ("regex", "gpt2")], None),
}


def from_gguf_pre(name):
    if name not in GGUF_PRE:
        raise TokenizerUnsupported("pre-tokenizer", name, sorted(GGUF_PRE))
    steps, normal_form = GGUF_PRE[name]
    return PreTokenizer(steps, normal_form)


_NORMAL_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def flatten(node, key):
    """The leaves of a tokenizer.json node that may be a Sequence (`key` names its list)."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [leaf for child in node[key] for leaf in flatten(child, key)]
    return [node]


def from_hf_byte_level(normalizer, pre_tokenizer):
    """The PreTokenizer for a byte-level BPE tokenizer.json (its normalizer and pre_tokenizer)."""
    normal_form = None
    for node in flatten(normalizer, "normalizers"):
        if node["type"] not in _NORMAL_FORMS or normal_form is not None:
            raise TokenizerUnsupported("normalizer", node["type"], _NORMAL_FORMS)
        normal_form = node["type"]
    steps, prefix_space, byte_level = [], False, False
    for node in flatten(pre_tokenizer, "pretokenizers"):
        kind = node["type"]
        if kind == "ByteLevel":
            byte_level = True
            if node.get("add_prefix_space"):
                if steps:
                    raise TokenizerUnsupported("pre-tokenizer", "ByteLevel(add_prefix_space) "
                                               "after another split")
                prefix_space = True
            if node.get("use_regex", True):
                steps.append(("regex", "gpt2"))
        elif kind == "Split":
            pattern = node["pattern"].get("Regex")
            name = next((n for n, p in PATTERNS.items() if p == pattern), None)
            if name is None or node.get("behavior") != "Isolated" or node.get("invert"):
                raise TokenizerUnsupported("split pattern", pattern or str(node["pattern"]),
                                           sorted(PATTERNS))
            steps.append(("regex", name))
        elif kind == "Digits":
            steps.append(("digits", bool(node.get("individual_digits"))))
        else:
            raise TokenizerUnsupported("pre-tokenizer", kind, ["ByteLevel", "Split", "Digits"])
    if not byte_level:
        raise TokenizerUnsupported("pre-tokenizer", "byte-level BPE without ByteLevel")
    return PreTokenizer(steps, normal_form, prefix_space)


class SentencePieceSpaces:
    """SentencePiece's handling of spaces: each is spelled '▁' and one '▁' is prepended to a
    segment; `prepend` says which: "always" (every segment, as Llama's add_space_prefix and the
    Prepend normalizer do), "first" (only a segment that starts the text) or "never".

    `metaspace` selects the rules of tokenizer.json's Metaspace pre-tokenizer: no '▁' is
    prepended to a segment that already starts with one, and with `split` every '▁' starts a new
    word."""

    def __init__(self, prepend="always", metaspace=False, split=False):
        self.prepend, self.metaspace, self.split = prepend, metaspace, split

    def __repr__(self):
        return (f"SentencePieceSpaces({self.prepend!r}, metaspace={self.metaspace}, "
                f"split={self.split})")

    def words(self, text, first=True):
        if not text:
            return []
        text = text.replace(" ", "▁")
        if self.prepend == "always" or (self.prepend == "first" and first):
            if not (self.metaspace and text.startswith("▁")):
                text = "▁" + text
        if not self.split:
            return [text]
        cuts = [i for i, c in enumerate(text) if c == "▁" and i > 0]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def from_hf_sentencepiece(normalizer, pre_tokenizer):
    """The SentencePieceSpaces of a SentencePiece-style tokenizer.json: either the normalizers
    Prepend('▁') + Replace(' ', '▁') (Llama 2) or a Metaspace pre-tokenizer."""
    prepend, spaced, metaspace, split = "never", False, False, False
    for node in flatten(normalizer, "normalizers"):
        if node["type"] == "Prepend" and node["prepend"] == "▁":
            prepend = "always"
        elif (node["type"] == "Replace" and node["pattern"].get("String") == " "
              and node["content"] == "▁"):
            spaced = True
        else:
            raise TokenizerUnsupported("normalizer", node["type"], ["Prepend('▁')",
                                                                    "Replace(' ', '▁')"])
    for node in flatten(pre_tokenizer, "pretokenizers"):
        if node["type"] != "Metaspace" or node.get("replacement", "▁") != "▁":
            raise TokenizerUnsupported("pre-tokenizer", node["type"], ["Metaspace", "ByteLevel"])
        spaced = metaspace = True
        split = node.get("split", True)
        prepend = node.get("prepend_scheme") or ("always" if node.get("add_prefix_space", True)
                                                 else "never")
    if not spaced:
        raise TokenizerUnsupported("pre-tokenizer", "neither ByteLevel nor SentencePiece spaces")
    return SentencePieceSpaces(prepend, metaspace, split)
