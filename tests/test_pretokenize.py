"""Pre-tokenizers against independent oracles: the `regex` module running the published patterns
and Hugging Face `tokenizers` running the same pre-tokenizer configuration."""

import json
import re
import sys
import unicodedata

import pytest

from poot.text.bpe import byte_level_text
from poot.text.pretokenize import (PATTERNS, PreTokenizer, SentencePieceSpaces,
                                   TokenizerUnsupported, compiled, from_gguf_pre,
                                   from_hf_byte_level, translate)

regex = pytest.importorskip("regex")
hf_pre = pytest.importorskip("tokenizers.pre_tokenizers")
from tokenizers import Regex  # noqa: E402

from tests.published_tokenizers import PUBLISHED, STRESS  # noqa: E402
DECOMPOSED = [d for d in (unicodedata.normalize("NFD", s) for s in STRESS) if d not in STRESS]


def hf_pieces(pre_tokenizer, text):
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_published_pattern_splits_like_the_regex_module(name):
    # MULTILINE: Oniguruma's `$` is the end of any line.
    oracle, ours = regex.compile(PATTERNS[name], regex.MULTILINE), compiled(name)
    for text in STRESS + DECOMPOSED:
        assert ours.findall(text) == oracle.findall(text), repr(text)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_published_pattern_splits_like_hf_split(name):
    oracle = hf_pre.Split(Regex(PATTERNS[name]), behavior="isolated")
    ours = PreTokenizer([("regex", name)])
    for text in STRESS:
        assert ours.split(text) == hf_pieces(oracle, text), repr(text)


def test_unicode_classes_agree_with_the_regex_module():
    # Every code point this Python's unicodedata assigns (the regex module may know a newer
    # Unicode, whose additions are unassigned here).
    assigned = "".join(chr(cp) for cp in range(sys.maxunicode + 1)
                       if not 0xD800 <= cp < 0xE000 and unicodedata.category(chr(cp)) != "Cn")
    for published in (r"\p{L}", r"\p{N}", r"\p{M}", r"\p{P}", r"\s", r"[^\s\p{L}\p{N}]",
                      r"[^\s\p{L}\p{M}\p{N}]", r"\S"):
        assert re.findall(translate(published), assigned) == regex.findall(published, assigned)


def test_smollm_digits_then_gpt2_like_hf():
    # SmolLM2's tokenizer.json: Sequence[Digits(individual_digits), ByteLevel(use_regex)].
    oracle = hf_pre.Sequence([hf_pre.Digits(individual_digits=True),
                              hf_pre.ByteLevel(add_prefix_space=False, use_regex=True)])
    ours = from_gguf_pre("smollm")
    for text in STRESS:
        assert ours.words(text) == hf_pieces(oracle, text), repr(text)
    assert ours.words("a 123") == ["a", "Ġ", "1", "2", "3"]


@pytest.mark.parametrize("individual", [True, False])
def test_digits_like_hf(individual):
    oracle = hf_pre.Digits(individual_digits=individual)
    ours = PreTokenizer([("digits", individual)])
    for text in STRESS:
        assert ours.split(text) == hf_pieces(oracle, text), repr(text)


def test_byte_level_prefix_space_like_hf():
    oracle = hf_pre.ByteLevel(add_prefix_space=True, use_regex=True)
    ours = from_hf_byte_level(None, json.loads(oracle.__getstate__()))
    for text in STRESS:
        assert ours.words(text) == hf_pieces(oracle, text), repr(text)


def test_gguf_names():
    assert from_gguf_pre("llama-bpe").steps == (("regex", "llama3"), ("bytes", None))
    assert from_gguf_pre("qwen2").normal_form == "NFC"
    assert from_gguf_pre("qwen2").words("e\u0301!") == [byte_level_text("\u00e9".encode()), "!"]
    assert from_gguf_pre("default").words("I'm  here") == ["I", "'m", "Ġ", "Ġhere"]
    assert from_gguf_pre("gemma4").words("a b\n\nc ") == ["a▁b", "\n\n", "c▁"]
    with pytest.raises(TokenizerUnsupported, match="bloom") as refused:
        from_gguf_pre("bloom")
    assert refused.value.exit_status == 7


def test_hf_split_with_an_unknown_pattern_is_refused():
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\w+|\s+"}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    with pytest.raises(TokenizerUnsupported, match="split pattern"):
        from_hf_byte_level(None, pre)
    with pytest.raises(TokenizerUnsupported, match="Whitespace"):
        from_hf_byte_level(None, {"type": "Whitespace"})


def test_sentencepiece_spaces():
    llama = SentencePieceSpaces("always")
    assert llama.words("Hello world") == ["▁Hello▁world"]
    assert llama.words(" x", first=False) == ["▁▁x"]
    assert llama.words("") == []
    metaspace = SentencePieceSpaces("first", metaspace=True, split=True)
    assert metaspace.words("a b  c") == ["▁a", "▁b", "▁", "▁c"]
    assert metaspace.words(" a") == ["▁a"]
    assert metaspace.words("a", first=False) == ["a"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_gguf_pre_splits_like_its_published_pre_tokenizer(name):
    normalizer, oracle = PUBLISHED[name]
    ours = from_gguf_pre(name)
    for text in STRESS + DECOMPOSED:
        normalized = normalizer.normalize_str(text) if normalizer else text
        assert ours.words(text) == hf_pieces(oracle, normalized), repr(text)


def test_falcon_splits_digits_in_the_byte_spelling():
    # '½' is the bytes C2 BD; BD spells itself '½', a number, so the digit steps cut it off.
    words = from_gguf_pre("falcon").words("ied 4 ½ months 1234567, x!!")
    assert words == ["ied", "Ġ", "4", "ĠÂ", "½", "Ġmonths", "Ġ", "123", "456", "7", ",", "Ġx",
                     "!!"]


def test_deepseek_trailing_space_is_its_own_word():
    assert from_gguf_pre("deepseek-llm").words("Hi  \nyo   ") == ["Hi", "ĠĠ", "Ċ", "yo", "ĠĠĠ"]
    assert from_gguf_pre("deepseek-coder").words("x=12;") == ["x", "=", "1", "2", ";"]
