"""The tokenizer: text <-> token ids, built from a GGUF file's metadata or a tokenizer.json.

Encoding cuts the text at special and added tokens written in it, cuts each remaining segment
into words (pretokenize.py), encodes each word with BPE (bpe.py) and adds BOS/EOS by the model's
rules. Decoding joins the bytes each token stands for; `IncrementalDecoder` does the same one token
at a time for streaming, holding back bytes that do not yet form a character. Not here: chat
templates (chat.py).
"""

import codecs
import re

from poot.errors import ModelFileError
from poot.text.bpe import ByteLevelBPE, SentencePieceBPE, byte_level_bytes, parse_merges
from poot.text.pretokenize import (WHITE_SPACE, SentencePieceSpaces, TokenizerUnsupported,
                                   flatten, from_gguf_pre, from_hf_byte_level,
                                   from_hf_sentencepiece)

# GGUF token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in WHITE_SPACE) + "]*"
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")


class Tokenizer:
    """A BPE tokenizer. Build it with `from_gguf` or `from_hf`.

    `tokens[i]` is token i as the vocabulary spells it and `token_types[i]` its GGUF type;
    `model` encodes one word; `pre` cuts a segment into words; `prefix_ids`/`suffix_ids` are
    what `encode(add_special=True)` puts around the text; `lstrip`/`rstrip` name the added tokens
    that swallow the whitespace beside them; `strip_leading_space` drops the space SentencePiece
    prepended when decoding."""

    def __init__(self, tokens, token_types, model, pre, *, byte_level, bos_id=None,
                 eos_ids=(), pad_id=None, prefix_ids=(), suffix_ids=(),
                 strip_leading_space=False, lstrip=frozenset(), rstrip=frozenset()):
        self.tokens, self.token_types = list(tokens), list(token_types)
        self.model, self.pre = model, pre
        self.bos_id, self.pad_id = bos_id, pad_id
        self.eos_ids = frozenset(eos_ids)
        self.prefix_ids, self.suffix_ids = list(prefix_ids), list(suffix_ids)
        self.strip_leading_space = strip_leading_space
        self.vocab_size = len(self.tokens)
        self.special_ids = frozenset(i for i, t in enumerate(self.token_types) if t == CONTROL)
        self._skipped = frozenset(i for i, t in enumerate(self.token_types)
                                  if t in (CONTROL, UNKNOWN))
        self._bytes = [_token_bytes(text, kind, byte_level)
                       for text, kind in zip(self.tokens, self.token_types)]
        # A special token's text names the special token, even where a normal one spells alike.
        self._ids = {}
        for marked_first in (True, False):
            for i, (text, kind) in enumerate(zip(self.tokens, self.token_types)):
                if text and (kind in (CONTROL, UNKNOWN, USER_DEFINED)) == marked_first:
                    self._ids.setdefault(text, i)
        # Written-out special tokens: control (and unknown) ones only when parse_special is set,
        # user-defined ones always, since the model was trained on them as single tokens.
        marked = [(i, text) for i, (text, kind) in enumerate(zip(self.tokens, self.token_types))
                  if text and kind in (CONTROL, UNKNOWN, USER_DEFINED)]
        self._special_matcher = _SpecialMatcher(marked, lstrip, rstrip)
        self._user_matcher = _SpecialMatcher([(i, text) for i, text in marked
                                              if self.token_types[i] == USER_DEFINED],
                                             lstrip, rstrip)

    def __repr__(self):
        return (f"Tokenizer(vocab_size={self.vocab_size}, model={type(self.model).__name__}, "
                f"pre={self.pre!r})")

    # -- building ----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata):
        """From GGUF metadata (key -> value); `tokenizer.ggml.model` is "gpt2" (byte-level BPE
        with merges), "llama" (SentencePiece BPE with scores and byte fallback) or "gemma4"
        (SentencePiece BPE with merges and byte fallback)."""
        def get(key, default=None):
            value = metadata.get("tokenizer.ggml." + key)
            return default if value is None else value

        def need(key):
            if metadata.get("tokenizer.ggml." + key) is None:
                raise ModelFileError("<GGUF metadata>", f"tokenizer.ggml.{key} is missing")
            return metadata["tokenizer.ggml." + key]

        kind, pre_name = get("model"), get("pre", "default")
        tokens = [str(t) for t in need("tokens")]
        types = [int(t) for t in get("token_type", [NORMAL] * len(tokens))]
        bos, eos, unk, pad = (get(k + "_token_id") for k in ("bos", "eos", "unknown", "padding"))
        if kind == "gemma4" or (kind == "gpt2" and pre_name == "gemma4"):
            # SentencePiece-style pieces merged by rank; BOS always, as llama.cpp reads these
            # files. A merged piece is looked up among all the tokens, control ones too, as
            # tokenizer.json's BPE looks it up.
            vocab = _vocab(tokens, types, set(types))
            model = SentencePieceBPE(vocab, merges=parse_merges(need("merges")),
                                     byte_ids=_byte_ids(tokens, types), unk_id=unk,
                                     whole_newlines=True)
            pre = from_gguf_pre("gemma4")
            add_bos, space_prefix, byte_level = True, False, False
        elif kind == "gpt2":
            pre = from_gguf_pre(pre_name)
            vocab = _vocab(tokens, types, (NORMAL,))
            model = ByteLevelBPE(vocab, parse_merges(need("merges")),
                                 ignore_merges=pre_name in _LLAMA3_PRE)
            add_bos, space_prefix = bool(get("add_bos_token", pre_name in _LLAMA3_PRE)), False
            byte_level = True
        elif kind == "llama":
            vocab = _vocab(tokens, types, (NORMAL, USER_DEFINED))
            scores = [float(s) for s in need("scores")]
            model = SentencePieceBPE(vocab, scores={t: scores[i] for t, i in vocab.items()},
                                     byte_ids=_byte_ids(tokens, types), unk_id=unk)
            space_prefix = bool(get("add_space_prefix", True))
            pre = SentencePieceSpaces("always" if space_prefix else "never")
            add_bos, byte_level = bool(get("add_bos_token", True)), False
        else:
            raise TokenizerUnsupported("model", kind, ["gpt2", "llama", "gemma4"])
        add_eos = bool(get("add_eos_token", False))
        return cls(tokens, types, model, pre, byte_level=byte_level,
                   bos_id=None if bos is None else int(bos),
                   pad_id=None if pad is None else int(pad),
                   eos_ids={int(get(k)) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
                            if get(k) is not None},
                   prefix_ids=[int(bos)] if add_bos and bos is not None else [],
                   suffix_ids=[int(eos)] if add_eos and eos is not None else [],
                   strip_leading_space=space_prefix)

    @classmethod
    def from_hf(cls, tokenizer_json, tokenizer_config=None, generation_config=None):
        """From a Hugging Face tokenizer.json (a BPE model, byte-level or SentencePiece style),
        with BOS/EOS from tokenizer_config.json and extra EOS ids from generation_config.json."""
        config, generation = tokenizer_config or {}, generation_config or {}
        if not tokenizer_json or "model" not in tokenizer_json:
            raise ModelFileError("tokenizer.json", "missing, or holds no tokenizer model")
        m = tokenizer_json["model"]
        if m.get("type", "BPE") != "BPE":
            raise TokenizerUnsupported("model", m.get("type"), ["BPE"])
        for option in ("continuing_subword_prefix", "end_of_word_suffix"):
            if m.get(option):
                raise TokenizerUnsupported("BPE option", option)
        if m.get("dropout"):
            raise TokenizerUnsupported("BPE option", "dropout")
        added = tokenizer_json.get("added_tokens") or []
        size = 1 + max([*m["vocab"].values(), *(a["id"] for a in added)])
        tokens, types = [""] * size, [UNUSED] * size
        for text, i in m["vocab"].items():
            tokens[i], types[i] = text, NORMAL
        byte_fallback = bool(m.get("byte_fallback"))
        if byte_fallback:
            for i, text in enumerate(tokens):
                if _BYTE_TOKEN.fullmatch(text):
                    types[i] = BYTE
        vocab = _vocab(tokens, types, (NORMAL,))
        unk = vocab.get(m["unk_token"]) if m.get("unk_token") is not None else None
        if unk is not None:
            types[unk] = UNKNOWN
        lstrip, rstrip = set(), set()
        for a in added:
            if a.get("single_word"):
                raise TokenizerUnsupported("added token option", f"single_word ({a['content']})")
            tokens[a["id"]] = a["content"]
            types[a["id"]] = CONTROL if a.get("special") else USER_DEFINED
            if a.get("lstrip"):
                lstrip.add(a["id"])
            if a.get("rstrip"):
                rstrip.add(a["id"])
        merges = parse_merges(m.get("merges") or [])
        normalizer = tokenizer_json.get("normalizer")
        pre_tokenizer, decoder = tokenizer_json.get("pre_tokenizer"), tokenizer_json.get("decoder")
        byte_level = any(n["type"] == "ByteLevel" for n in
                         flatten(pre_tokenizer, "pretokenizers") + flatten(decoder, "decoders"))
        if byte_level:
            pre = from_hf_byte_level(normalizer, pre_tokenizer)
            model = ByteLevelBPE(vocab, merges, ignore_merges=bool(m.get("ignore_merges")))
            strip = False
        else:
            pre, strip = from_hf_sentencepiece(normalizer, pre_tokenizer), _hf_strips(decoder)
            model = SentencePieceBPE(vocab, merges=merges,
                                     byte_ids=_byte_ids(tokens, types) if byte_fallback else None,
                                     unk_id=unk, fuse_unk=bool(m.get("fuse_unk")))

        added_ids = {a["content"]: a["id"] for a in added}

        def config_id(key):
            value = config.get(key)
            if isinstance(value, dict):                    # an AddedToken written out
                value = value.get("content")
            return None if value is None else added_ids.get(value, vocab.get(value))

        prefix, suffix = _hf_template(tokenizer_json.get("post_processor"))
        bos, eos = config_id("bos_token"), config_id("eos_token")
        if bos is None and len(prefix) == 1:
            bos = prefix[0]
        if config.get("add_bos_token") is not None:
            prefix = [bos] if config["add_bos_token"] and bos is not None else []
        if config.get("add_eos_token") is not None:
            suffix = [eos] if config["add_eos_token"] and eos is not None else []
        extra = generation.get("eos_token_id")
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        return cls(tokens, types, model, pre, byte_level=byte_level, bos_id=bos,
                   pad_id=config_id("pad_token"),
                   eos_ids={*extra, *([eos] if eos is not None else [])},
                   prefix_ids=prefix, suffix_ids=suffix, strip_leading_space=strip,
                   lstrip=lstrip, rstrip=rstrip)

    # -- use -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list:
        """Token ids of `text`. `add_special` adds BOS/EOS as the model does; `parse_special`
        turns control tokens written in the text (`<|im_start|>`) into their ids, where otherwise
        they are encoded as plain text."""
        ids = list(self.prefix_ids) if add_special else []
        matcher = self._special_matcher if parse_special else self._user_matcher
        at = 0
        for start, end, token_id in matcher.find(text):
            if start > at:
                self._encode_segment(text[at:start], at == 0, ids)
            ids.append(token_id)
            at = end
        if at < len(text):
            self._encode_segment(text[at:], at == 0, ids)
        if add_special:
            ids.extend(self.suffix_ids)
        return ids

    def _encode_segment(self, segment, first, ids):
        encode_word = self.model.encode_word
        for word in self.pre.words(segment, first):
            ids.extend(encode_word(word))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a control token: its text)."""
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return self._bytes[token_id]

    def token_to_id(self, text: str):
        return self._ids.get(text)

    def _piece(self, token_id, skip_special):
        if not 0 <= token_id < self.vocab_size or (skip_special and token_id in self._skipped):
            return b""
        return self._bytes[token_id]

    def decode(self, ids, skip_special: bool = False) -> str:
        """The text of `ids`; ids outside the vocabulary (padding rows of the embedding) decode
        to nothing, and bytes that do not form UTF-8 to U+FFFD."""
        data = b"".join(self._piece(i, skip_special) for i in ids)
        if self.strip_leading_space and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", "replace")

    def decoder(self, skip_special: bool = False):
        return IncrementalDecoder(self, skip_special)


class IncrementalDecoder:
    """Decodes a stream of token ids; `push` returns only whole characters, and the pushes plus
    `flush` add up to `Tokenizer.decode` of all the ids."""

    def __init__(self, tokenizer, skip_special=False):
        self._tokenizer, self._skip_special = tokenizer, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._at_start = tokenizer.strip_leading_space

    def push(self, token_id: int) -> str:
        data = self._tokenizer._piece(token_id, self._skip_special)
        if self._at_start and data:
            self._at_start = False
            if data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _hf_strips(decoder):
    """Whether a SentencePiece-style decoder drops the leading space of the decoded text."""
    strip = False
    for node in flatten(decoder, "decoders"):
        kind = node["type"]
        if kind == "Strip" and node.get("content") == " " and node.get("stop", 0) == 0:
            strip = node.get("start", 0) == 1
            if node.get("start", 0) > 1:
                raise TokenizerUnsupported("decoder", f"Strip(start={node['start']})")
        elif kind == "Metaspace":
            strip = (node.get("prepend_scheme") or
                     ("always" if node.get("add_prefix_space", True) else "never")) != "never"
        elif not (kind in ("ByteFallback", "Fuse") or
                  (kind == "Replace" and node["content"] == " "
                   and node["pattern"].get("String") == "▁")):
            raise TokenizerUnsupported("decoder", kind, ["Replace('▁', ' ')", "ByteFallback",
                                                         "Fuse", "Strip", "Metaspace"])
    return strip


def _hf_template(post_processor):
    """The ids a post-processor puts before and after a single text (TemplateProcessing's
    `single`; ByteLevel post-processing adds none)."""
    prefix, suffix = [], []
    for node in flatten(post_processor, "processors"):
        if node["type"] == "TemplateProcessing":
            seen_text = False
            for item in node["single"]:
                if "Sequence" in item:
                    seen_text = True
                else:
                    ids = node["special_tokens"][item["SpecialToken"]["id"]]["ids"]
                    (suffix if seen_text else prefix).extend(ids)
        elif node["type"] != "ByteLevel":
            raise TokenizerUnsupported("post-processor", node["type"],
                                       ["TemplateProcessing", "ByteLevel"])
    return prefix, suffix


def _token_bytes(text, kind, byte_level):
    if kind == BYTE:
        return bytes([int(_BYTE_TOKEN.fullmatch(text).group(1), 16)])
    # GGUF strings that are not UTF-8 arrive surrogate-escaped; this gives their bytes back.
    if kind != NORMAL:
        return text.encode("utf-8", "surrogateescape")
    if byte_level:
        return byte_level_bytes(text)
    return text.replace("▁", " ").encode("utf-8", "surrogateescape")


def _vocab(tokens, types, kinds):
    vocab = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind in kinds:
            vocab.setdefault(text, i)
    return vocab


def _byte_ids(tokens, types):
    """The 256 `<0xXX>` byte-token ids, or None when the vocabulary lacks any of them."""
    ids = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        m = _BYTE_TOKEN.fullmatch(text)
        if kind == BYTE and m:
            ids.setdefault(int(m.group(1), 16), i)
    return [ids[b] for b in range(256)] if len(ids) == 256 else None


class _SpecialMatcher:
    """Finds written-out tokens in text, leftmost and then longest first (as Hugging Face's
    added-token matcher does); a token in `lstrip`/`rstrip` takes the whitespace beside it."""

    def __init__(self, marked, lstrip, rstrip):
        marked = sorted(marked, key=lambda it: -len(it[1]))
        self._ids = [None] + [i for i, _ in marked]
        alternatives = [(f"{_SPACE if i in lstrip else ''}{re.escape(text)}"
                         f"{_SPACE if i in rstrip else ''}") for i, text in marked]
        # The search runs group-free, so that `re` finds the alternatives' common prefix (the
        # '<' of most) by a fast scan; a match names its token by its text, or, where it took
        # whitespace beside an lstrip/rstrip token, by the grouped pattern's lastindex there.
        self._regex = re.compile("|".join(alternatives)) if marked else None
        self._grouped = re.compile("|".join(f"({a})" for a in alternatives)) if marked else None
        self._by_text = {}
        for i, text in marked:
            self._by_text.setdefault(text, i)

    def find(self, text):
        """(start, end, token id) of each written-out token in `text`."""
        if self._regex is not None:
            for m in self._regex.finditer(text):
                token_id = self._by_text.get(m.group())
                if token_id is None:
                    token_id = self._ids[self._grouped.match(text, m.start()).lastindex]
                yield m.start(), m.end(), token_id
