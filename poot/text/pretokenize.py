"""Pre-tokenizers: how a text segment is cut into the words that BPE then encodes one at a time.

A pre-tokenizer is the pipeline a model's `tokenizer.json` describes: a Unicode normalization,
then steps that each cut every piece so far: split at the matches of a published regex (keeping
the matches and the text between them, as `Split(behavior="Isolated")` does), split off digits,
and the byte-level step that spells every byte as GPT-2's printable character (or, for Gemma 4's
SentencePiece-style pieces, the step that spells a space '▁'). Steps after the byte-level one see
that spelling, as they do in Hugging Face `tokenizers` (Falcon splits digits there). The words
come out in the vocabulary's alphabet, ready for BPE.

Each published pattern is translated once into a stdlib `re` pattern: `\\p{L}`, `\\p{N}`,
`\\p{M}`, `\\p{P}` and `\\s` become explicit character classes built from `unicodedata`
(general categories L*, N*, M*, P*, the White_Space property) and `$` the end of a line, so
matching runs in C with exactly the published semantics. A pattern not in `PATTERNS` is refused
rather than run under a different regex dialect. Not here: BPE (bpe.py), special tokens
(tokenizer.py).
"""

import functools
import itertools
import re
import sys
import unicodedata

from poot.errors import PootError
from poot.text.bpe import byte_level_text


class TokenizerUnsupported(PootError):
    """A tokenizer file asks for a model, pre-tokenizer or option poot does not implement."""
    exit_status = 7

    def __init__(self, what, name, supported=()):
        self.what, self.name, self.supported = what, name, tuple(supported)
        message = f"unsupported tokenizer {what} {name!r}"
        if self.supported:
            message += f" (supported: {', '.join(self.supported)})"
        super().__init__(message)


# DeepSeek LLM's letters: the cased letters (Lu, Ll, Lt) of the Unicode its tokenizer was built
# with, spelled as its tokenizer.json spells them (escaped here, since several are canonical
# singletons such as U+2126 OHM SIGN that an editor's normalization would silently change).
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")

# The split patterns exactly as they are spelled in the published tokenizer.json files.
PATTERNS = {
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    "llama3": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # Qwen3.5: combining marks join a run of letters and leave the run of symbols.
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # DeepSeek LLM and DeepSeek Coder: a sequence of splits, each on the pieces of the last.
    "newline": "[\r\n]",
    "deepseek-letters": r"\s?[" + _DEEPSEEK_LETTERS + "]+",
    "deepseek-punctuation": "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "trailing-space": r"\s+$",
    "cjk": "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "letters": r"\s?\p{L}+",
    "punctuation": r"\s?\p{P}+",
    # Falcon: its Punctuation(Contiguous) pre-tokenizer (a run of ASCII punctuation and of
    # Unicode P*), then a split into digit triples.
    "punctuation-run": r"[!-/:-@\[-`{-~\p{P}]+",
    "digit-triples": "[0-9][0-9][0-9]",
    # Gemma 4: lines and runs of newlines, nothing else.
    "lines": "[^\n]+|[\n]+",
}

# The Unicode White_Space property (PropList.txt), which is what `\s` means in the published
# patterns; str.isspace() differs (it also counts U+001C..U+001F).
WHITE_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
               (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
               (0x3000, 0x3000)]
_CATEGORIES = ("L", "N", "M", "P")


@functools.cache
def _category_ranges():
    """{'L': [(lo, hi), ...], 'N': [...], ...} over all code points, from this Python's
    unicodedata."""
    ranges = {major: [] for major in _CATEGORIES}
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
    escapes = {f"p{{{major}}}": _class_body(ranges[major]) for major in _CATEGORIES}
    escapes["s"] = _class_body(WHITE_SPACE)
    return escapes


def translate(pattern):
    """A published (Oniguruma-dialect) split pattern as an equivalent stdlib `re` pattern."""
    classes, out, i, in_class = _escapes(), [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            escape = next((e for e in (*classes, "S") if pattern.startswith(e, i + 1)), None)
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
        elif c == "$" and not in_class:
            c = "(?m:$)"                   # Oniguruma's `$` is the end of any line
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


def _isolate(regex, pieces):
    """Each piece split at the matches of `regex`, keeping the matches and the text between
    them: the parts re.split gives for the pattern in one group, the empty ones left out."""
    out = []
    for piece in pieces:
        out += filter(None, regex.split(piece))
    return out


@functools.cache
def _grouped(regex):
    """`regex` in one group, so that its split keeps the matches (the patterns have none)."""
    return re.compile(f"({regex.pattern})")


def _spell_bytes(pieces):
    """Every byte of the pieces spelled GPT-2's way, all in one text, then cut where the
    pieces' bytes end."""
    joined = "".join(pieces)
    if joined.isascii():                        # a character a byte
        ends = itertools.accumulate(map(len, pieces))
    else:
        ends = itertools.accumulate(len(piece.encode("utf-8")) for piece in pieces)
    spelled, at, out = byte_level_text(joined.encode("utf-8")), 0, []
    for end in ends:
        out.append(spelled[at:end])
        at = end
    return out


def _spell_spaces(pieces):
    return [piece.replace(" ", "\u2581") for piece in pieces]


class PreTokenizer:
    """Normalization plus a sequence of steps, each applied to every piece so far.

    `steps` holds ("regex", name), ("digits", individual), ("bytes", None) (spell every byte
    GPT-2's way) or ("spaces", None) (spell a space '▁') entries; `normal_form` is a unicodedata
    form such as "NFC" or None; `prefix_space` prepends a space to each segment that does not
    already start with one (ByteLevel's add_prefix_space).
    """

    def __init__(self, steps, normal_form=None, prefix_space=False):
        self.steps = tuple(steps)
        self.normal_form = normal_form
        self.prefix_space = prefix_space

    @functools.cached_property
    def _cuts(self):
        # Built on first use: the Unicode classes take a moment, and GGUF_PRE holds many.
        return [self._cut(kind, arg) for kind, arg in self.steps]

    @staticmethod
    def _cut(kind, arg):
        """A step as a function from the pieces so far to the next ones."""
        if kind == "regex":
            return functools.partial(_isolate, _grouped(compiled(arg)))
        if kind == "digits":
            return functools.partial(_isolate, _grouped(_digits(arg)))
        return {"bytes": _spell_bytes, "spaces": _spell_spaces}[kind]

    def __repr__(self):
        return f"PreTokenizer({self.steps!r}, normal_form={self.normal_form!r})"

    def normalize(self, text):
        if self.normal_form:
            text = unicodedata.normalize(self.normal_form, text)
        if self.prefix_space and text and not text.startswith(" "):
            text = " " + text
        return text

    def words(self, text, first=True):
        """The words of one text segment (`first` is unused: these steps treat all alike)."""
        return self.split(self.normalize(text))

    def split(self, text):
        pieces = [text] if text else []
        for cut in self._cuts:
            pieces = cut(pieces)
        return pieces


def byte_level(*steps, normal_form=None):
    """A byte-level pre-tokenizer: `steps` on the text, then every byte spelled GPT-2's way."""
    return PreTokenizer([*steps, ("bytes", None)], normal_form)


GPT2_REGEX, DIGITS = ("regex", "gpt2"), ("digits", True)

# tokenizer.ggml.pre names -> the pre-tokenizer the model was trained with, as its
# tokenizer.json defines it. "default" is what the converter writes for GPT-2-style vocabularies
# it does not otherwise name.
GGUF_PRE = {
    "default": byte_level(GPT2_REGEX),
    "gpt2": byte_level(GPT2_REGEX),
    "gpt-2": byte_level(GPT2_REGEX),
    "llama-bpe": byte_level(("regex", "llama3")),
    "llama3": byte_level(("regex", "llama3")),
    "llama-v3": byte_level(("regex", "llama3")),
    # Qwen's tokenizer.json files normalize to NFC before splitting; the GGUF has no key for it.
    "qwen2": byte_level(("regex", "qwen2"), normal_form="NFC"),
    "qwen35": byte_level(("regex", "qwen35"), normal_form="NFC"),
    "smollm": byte_level(DIGITS, GPT2_REGEX),
    "starcoder": byte_level(DIGITS, GPT2_REGEX),
    "refact": byte_level(DIGITS, GPT2_REGEX),
    "command-r": byte_level(DIGITS, GPT2_REGEX, normal_form="NFC"),
    # MPT's GPT-NeoX vocabulary: GPT-2's split after NFC; its runs of spaces are user-defined
    # tokens, which tokenizer.py matches before any of this.
    "mpt": byte_level(GPT2_REGEX, normal_form="NFC"),
    "deepseek-llm": byte_level(("regex", "newline"), ("regex", "deepseek-letters"),
                               ("regex", "deepseek-punctuation"), ("regex", "trailing-space"),
                               ("regex", "cjk"), DIGITS),
    "deepseek-coder": byte_level(("regex", "newline"), ("regex", "letters"),
                                 ("regex", "punctuation"), ("regex", "cjk"), DIGITS),
    # Falcon splits digits after the byte-level spelling, so the bytes that spell themselves as
    # numbers (B2 '²', BD '½', ...) split there too, as they do in `tokenizers`.
    "falcon": PreTokenizer([("regex", "punctuation-run"), GPT2_REGEX, ("bytes", None),
                            ("digits", False), ("regex", "digit-triples")]),
    # Gemma 4 (SentencePiece-style pieces, not byte-level): spaces spelled '▁', the text cut
    # only into lines and runs of newlines, as llama.cpp reads its GGUF files.
    "gemma4": PreTokenizer([("spaces", None), ("regex", "lines")]),
}


def from_gguf_pre(name):
    if name not in GGUF_PRE:
        raise TokenizerUnsupported("pre-tokenizer", name, sorted(GGUF_PRE))
    return GGUF_PRE[name]


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
        if kind == "ByteLevel" and not byte_level:
            byte_level = True
            if node.get("add_prefix_space"):
                if steps:
                    raise TokenizerUnsupported("pre-tokenizer", "ByteLevel(add_prefix_space) "
                                               "after another split")
                prefix_space = True
            if node.get("use_regex", True):
                steps.append(("regex", "gpt2"))
            steps.append(("bytes", None))
        elif kind == "Split":
            pattern = node["pattern"].get("Regex")
            name = next((n for n, p in PATTERNS.items() if p == pattern), None)
            if name is None or node.get("behavior") != "Isolated" or node.get("invert"):
                raise TokenizerUnsupported("split pattern", pattern or str(node["pattern"]),
                                           sorted(PATTERNS))
            steps.append(("regex", name))
        elif kind == "Digits":
            steps.append(("digits", bool(node.get("individual_digits"))))
        elif kind == "Punctuation" and node.get("behavior", "Isolated") == "Contiguous":
            steps.append(("regex", "punctuation-run"))
        else:
            raise TokenizerUnsupported("pre-tokenizer", kind, [
                "ByteLevel (once)", "Split", "Digits", "Punctuation(Contiguous)"])
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
