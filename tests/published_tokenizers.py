"""The oracles' side of the tokenizer tests: for each `tokenizer.ggml.pre` name, the normalizer and
pre-tokenizer its model's tokenizer.json declares, built from Hugging Face `tokenizers`' own
classes, and the texts every tokenizer test runs (the stress strings, and the inputs of llama.cpp's
tokenizer test vocabularies)."""

import json
import pathlib

from tokenizers import Regex, normalizers, pre_tokenizers

from poot.text.pretokenize import PATTERNS

DATA = pathlib.Path(__file__).parent / "data/tokenizer"
STRESS = (json.loads((DATA / "stress.json").read_text(encoding="utf-8"))
          + json.loads((DATA / "llama_cpp_inputs.json").read_text(encoding="utf-8")))


def split(name):
    return pre_tokenizers.Split(Regex(PATTERNS[name]), behavior="isolated")


def _bytes(use_regex):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _digits(individual=True):
    return pre_tokenizers.Digits(individual_digits=individual)


def _sequence(*steps):
    return pre_tokenizers.Sequence(list(steps))


# name -> (normalizer or None, pre_tokenizer), as the models' tokenizer.json files declare them.
PUBLISHED = {
    "gpt2": (None, _bytes(True)),
    "llama-bpe": (None, _sequence(split("llama3"), _bytes(False))),
    "qwen2": (normalizers.NFC(), _sequence(split("qwen2"), _bytes(False))),
    "qwen35": (normalizers.NFC(), _sequence(split("qwen35"), _bytes(False))),
    "smollm": (None, _sequence(_digits(), _bytes(True))),
    "refact": (None, _sequence(_digits(), _bytes(True))),
    "command-r": (normalizers.NFC(), _sequence(_digits(), _bytes(True))),
    "mpt": (normalizers.NFC(), _bytes(True)),
    "deepseek-llm": (None, _sequence(
        split("newline"), split("deepseek-letters"), split("deepseek-punctuation"),
        split("trailing-space"), split("cjk"), _digits(), _bytes(False))),
    "deepseek-coder": (None, _sequence(
        split("newline"), split("letters"), split("punctuation"), split("cjk"), _digits(),
        _bytes(False))),
    "falcon": (None, _sequence(
        pre_tokenizers.Punctuation(behavior="contiguous"), _bytes(True), _digits(False),
        pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), behavior="isolated"))),
}
NFC = {name for name, (normalizer, _) in PUBLISHED.items() if normalizer is not None}
