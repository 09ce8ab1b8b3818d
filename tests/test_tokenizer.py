"""Tokenizer against independent oracles: Hugging Face `tokenizers` on the same vocabulary, merges
and pre-tokenizer (the default SmolLM2 model, small BPE models trained here for each GGUF
pre-tokenizer name and for Gemma 4's kind of vocabulary, and llama.cpp's own test vocabularies
where they are at hand), and `sentencepiece` for SentencePiece BPE. Token ids must be exactly the
oracle's, decoding must give the oracle's text, and streaming must add up to decoding."""

import io
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import time
import unicodedata
from types import SimpleNamespace

import pytest

import poot
from poot.errors import ModelFileError
from poot.formats.gguf import write_gguf
from poot.text import Tokenizer, TokenizerUnsupported
from poot.text.bpe import BYTE_CHARS, merge
from poot.text.pretokenize import PATTERNS
from poot.text.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED

hf = pytest.importorskip("tokenizers")
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers  # noqa: E402

from tests.published_tokenizers import DATA, NFC, PUBLISHED, STRESS  # noqa: E402

ENGLISH = (DATA / "english.txt").read_text(encoding="utf-8")
SMOLLM2 = pathlib.Path(os.path.expanduser("~/.cache/poot/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n"
        "<|im_start|>user\nWhat's 2+2? Don't write <|im_end|> yourself.<|im_end|>\n"
        "<|im_start|>assistant\n")
TEXTS = STRESS + [CHAT, ENGLISH]


def hf_ids(oracle, text, add_special=False, parse_special=True):
    oracle.encode_special_tokens = not parse_special
    return oracle.encode(text, add_special_tokens=add_special).ids


def streamed(tok, ids, skip_special=False):
    decoder = tok.decoder(skip_special)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


def representable(tok, text):
    """Whether every byte of `text` has a token (SmolLM2 has none for a few control bytes)."""
    return all(tok.token_to_id(BYTE_CHARS[b]) is not None for b in text.encode())


def check_against(tok, oracle, texts=TEXTS, parse_special=(True, False), exact_text=True):
    """Encode, decode and stream every text with `tok` and the HF `oracle`; all must agree."""
    for text in texts:
        for parse in parse_special:
            ids = tok.encode(text, add_special=False, parse_special=parse)
            assert ids == hf_ids(oracle, text, parse_special=parse), (repr(text), parse)
            decoded = tok.decode(ids)
            assert decoded == oracle.decode(ids, skip_special_tokens=False), repr(text)
            if exact_text and all(tok.token_bytes(i) for i in tok.encode(text, False, False)) \
                    and representable(tok, text):
                assert decoded == text
            pieces = streamed(tok, ids)
            assert "".join(pieces) == decoded
            assert all("\ufffd" not in p for p in pieces), repr(text)
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special=True) == oracle.decode(ids, skip_special_tokens=True)
        assert "".join(streamed(tok, ids, True)) == tok.decode(ids, skip_special=True)


# -- the default model: SmolLM2's GGUF, read by poot's own reader ------------------------------

def smollm2_hf_json(metadata):
    """SmolLM2's tokenizer.json, rebuilt from the GGUF's vocabulary and merges with the published
    pre-tokenizer (Digits(individual_digits) then ByteLevel with the GPT-2 regex)."""
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, (t, kind) in enumerate(zip(tokens, types)) if kind == CONTROL],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in metadata["tokenizer.ggml.merges"]]},
    }


@pytest.fixture(scope="module")
def smollm2():
    gguf = pytest.importorskip("poot.formats.gguf", reason="poot's GGUF reader is not there yet")
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} is not downloaded")
    metadata = gguf.GGUFFile(SMOLLM2).metadata
    tokenizer_json = smollm2_hf_json(metadata)
    return SimpleNamespace(metadata=metadata, tok=Tokenizer.from_gguf(metadata),
                           from_json=Tokenizer.from_hf(tokenizer_json),
                           oracle=hf.Tokenizer.from_str(json.dumps(tokenizer_json)))


def test_smollm2_gguf_matches_hf(smollm2):
    check_against(smollm2.tok, smollm2.oracle)


def test_smollm2_tokenizer_json_matches_hf(smollm2):
    check_against(smollm2.from_json, smollm2.oracle)


def test_smollm2_facts(smollm2):
    tok, from_json = smollm2.tok, smollm2.from_json
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (1, frozenset({2}), 2)
    assert tok.special_ids == frozenset(range(17))
    assert tok.token_to_id("<|im_end|>") == 2 and tok.token_to_id("no such token") is None
    assert tok.token_bytes(tok.token_to_id("Ġthe")) == b" the"
    assert tok.encode("Hi") == tok.encode("Hi", add_special=False)   # add_bos_token is False
    assert from_json.encode("Hi") == tok.encode("Hi")


def test_smollm2_special_tokens_only_when_parsed(smollm2):
    tok = smollm2.tok
    ids = tok.encode(CHAT)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 3
    plain = tok.encode(CHAT, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert tok.decode(plain) == CHAT
    assert tok.decode(ids, skip_special=True) == CHAT.replace("<|im_start|>", "").replace(
        "<|im_end|>", "")


def test_smollm2_throughput(smollm2):
    tok = Tokenizer.from_gguf(smollm2.metadata)
    text = ENGLISH * 2                                   # ~6 KB, a cold word cache
    start = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - start
    assert len(ids) > 1000 and elapsed < 0.5, f"{len(ids)} tokens in {elapsed:.3f}s"


# -- byte-level BPE trained here, one per pre-tokenizer -------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [ENGLISH] + STRESS


def _split_then_bytes(name):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERNS[name]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_byte_level(gguf_pre):
    """A small byte-level BPE tokenizer.json, trained with the pre-tokenizer (and normalizer)
    that the model named `gguf_pre` declares."""
    normalizer, pre_tokenizer = PUBLISHED[gguf_pre]
    oracle = hf.Tokenizer(models.BPE())
    oracle.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        oracle.normalizer = normalizer
    oracle.decoder = decoders.ByteLevel()
    oracle.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=900, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer_json = json.loads(oracle.to_str())
    tokenizer_json["model"]["ignore_merges"] = gguf_pre == "llama-bpe"    # as Llama 3 ships
    return tokenizer_json


def gguf_metadata(tokenizer_json, model, pre=None, **extra):
    """GGUF tokenizer metadata written the way the GGUF converter writes it for this vocabulary."""
    vocab = tokenizer_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in tokenizer_json["added_tokens"] if a["special"]}
    metadata = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": [CONTROL if t in special else NORMAL for t in tokens]}
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    if model == "gpt2":
        metadata["tokenizer.ggml.merges"] = [" ".join(m) if isinstance(m, list) else m
                                             for m in tokenizer_json["model"]["merges"]]
    metadata.update({"tokenizer.ggml." + k: v for k, v in extra.items()})
    return metadata


@pytest.fixture(scope="module", params=sorted(PUBLISHED))
def trained(request):
    tokenizer_json = train_byte_level(request.param)
    return request.param, tokenizer_json, hf.Tokenizer.from_str(json.dumps(tokenizer_json))


def test_trained_byte_level_from_hf(trained):
    name, tokenizer_json, oracle = trained
    tok = Tokenizer.from_hf(tokenizer_json)
    normalized = [unicodedata.normalize("NFC", t) for t in TEXTS]
    check_against(tok, oracle, exact_text=name not in NFC)
    check_against(tok, oracle, [t + "\u0301" for t in STRESS[:60]] + normalized[:40],
                  exact_text=name not in NFC)


def test_trained_byte_level_from_gguf(trained):
    name, tokenizer_json, oracle = trained
    tok = Tokenizer.from_gguf(gguf_metadata(tokenizer_json, "gpt2", name, eos_token_id=0,
                                            bos_token_id=0))
    check_against(tok, oracle, exact_text=name not in NFC)
    bos = [0] if name == "llama-bpe" else []       # Llama 3's converter default adds BOS
    assert tok.encode("hi") == bos + tok.encode("hi", add_special=False)


def test_llama3_ignore_merges_takes_whole_words():
    # "abc" is a token, but replaying the merges on "abc" joins "bc" first and stops at a|bc.
    vocab = {c: i for i, c in enumerate(BYTE_CHARS)}
    vocab.update({"bc": 256, "ab": 257, "abc": 258})
    tokenizer_json = json.loads(hf.Tokenizer(models.BPE()).to_str())
    tokenizer_json["pre_tokenizer"] = json.loads(_split_then_bytes("llama3").__getstate__())
    tokenizer_json["decoder"] = json.loads(decoders.ByteLevel().__getstate__())
    tokenizer_json["model"].update(vocab=vocab, merges=[["b", "c"], ["a", "b"], ["ab", "c"]])
    for ignore_merges, expected in [(True, [258]), (False, [vocab["a"], 256])]:
        tokenizer_json["model"]["ignore_merges"] = ignore_merges
        oracle = hf.Tokenizer.from_str(json.dumps(tokenizer_json))
        tok = Tokenizer.from_hf(tokenizer_json)
        assert tok.encode("abc") == hf_ids(oracle, "abc") == expected
        check_against(tok, oracle, STRESS[:100])
    metadata = gguf_metadata(tokenizer_json, "gpt2", "llama-bpe")
    assert Tokenizer.from_gguf(metadata).encode("abc", add_special=False) == [258]


# -- Gemma 4: SentencePiece-style pieces merged by rank ----------------------------------------

def gemma4_tokenizer_json():
    """A small tokenizer.json of Gemma 4's kind, trained here: spaces spelled '▁', the text cut
    into lines and runs of newlines, BPE by merge rank over characters, and the 256 `<0xXX>`
    tokens for the characters the trained vocabulary lacks."""
    oracle = hf.Tokenizer(models.BPE(byte_fallback=True))
    oracle.normalizer = hf.normalizers.Replace(" ", "▁")
    oracle.pre_tokenizer = pre_tokenizers.Split(Regex(PATTERNS["lines"]), behavior="isolated")
    oracle.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=900, special_tokens=["<pad>", "<bos>", "<eos>", *SPECIALS],
        limit_alphabet=150, show_progress=False))
    tokenizer_json = json.loads(oracle.to_str())
    vocab = tokenizer_json["model"]["vocab"]
    for b in range(256):                      # the stress strings teach it a few already
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tokenizer_json["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    return tokenizer_json


def gemma4_metadata(tokenizer_json):
    metadata = gguf_metadata(tokenizer_json, "gemma4", bos_token_id=1, eos_token_id=2)
    metadata["tokenizer.ggml.token_type"] = [
        BYTE if re.fullmatch("<0x[0-9A-F]{2}>", t) else kind
        for t, kind in zip(metadata["tokenizer.ggml.tokens"],
                           metadata["tokenizer.ggml.token_type"])]
    metadata["tokenizer.ggml.merges"] = [" ".join(m) if isinstance(m, list) else m
                                         for m in tokenizer_json["model"]["merges"]]
    return metadata


def test_gemma4_gguf_matches_hf():
    tokenizer_json = gemma4_tokenizer_json()
    oracle = hf.Tokenizer.from_str(json.dumps(tokenizer_json))
    tok = Tokenizer.from_gguf(gemma4_metadata(tokenizer_json))
    unseen = "ꙮ 𝄞 ☃ 我想在apple工作"
    check_against(tok, oracle, TEXTS + [unseen], exact_text=False)
    for text in TEXTS + [unseen]:      # every character has a token or its bytes' tokens
        ids = tok.encode(text, add_special=False, parse_special=False)
        if "<0x" not in text:           # the text "<0x41>" is the byte token for "A"
            assert tok.decode(ids) == text.replace("▁", " "), repr(text)
    assert any(tok.token_types[i] == BYTE for i in tok.encode(unseen))
    assert tok.encode("Hi there") == [1] + hf_ids(oracle, "Hi there")   # BOS, always


def test_gemma4_takes_a_run_of_newlines_whole():
    # The merges build "\n\n" but never "\n\n\n"; the vocabulary holds both whole. The oracle
    # takes whole words only with ignore_merges, which says the same here: of the words these
    # texts make, only runs of newlines are tokens that the merges would not build.
    tokens = ["<pad>", "<bos>", "<eos>", "\n", "\n\n", "\n\n\n", "a", "▁", "▁a",
              *(f"<0x{b:02X}>" for b in range(256))]
    tokenizer_json = json.loads(hf.Tokenizer(models.BPE(byte_fallback=True)).to_str())
    tokenizer_json["model"].update(vocab={t: i for i, t in enumerate(tokens)},
                                   merges=[["\n", "\n"], ["▁", "a"]], ignore_merges=True)
    tokenizer_json["normalizer"] = {"type": "Replace", "pattern": {"String": " "},
                                    "content": "▁"}
    tokenizer_json["pre_tokenizer"] = json.loads(
        pre_tokenizers.Split(Regex(PATTERNS["lines"]), behavior="isolated").__getstate__())
    tokenizer_json["added_tokens"] = [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for i in range(3)]
    oracle = hf.Tokenizer.from_str(json.dumps(tokenizer_json))
    tok = Tokenizer.from_gguf(gemma4_metadata(tokenizer_json))
    assert tok.encode("a\n\n\na a", add_special=False) == [6, 5, 6, 8]
    for text in ["\n\n\n\n", "a\n\n\n", "\n\n\n\n\n\n a", " a\n\na\n", "aa aaa"]:
        assert tok.encode(text, add_special=False) == hf_ids(oracle, text), repr(text)


# -- vocabulary-only GGUF files, as llama.cpp's ggml-vocab-*.gguf ------------------------------

ARCHITECTURE = {"falcon": "falcon", "mpt": "mpt", "refact": "refact", "command-r": "command-r",
                "deepseek-llm": "llama", "deepseek-coder": "llama", "qwen35": "qwen35"}


def test_vocabulary_only_gguf_loads_its_tokenizer(trained, tmp_path):
    """A file of tokenizer metadata and no tensors, of an architecture poot may not run, is
    read by poot.load(weights=False) (what `poot tokenize` uses) with its pre-tokenizer."""
    name, tokenizer_json, oracle = trained
    path = tmp_path / f"ggml-vocab-{name}.gguf"
    metadata = gguf_metadata(tokenizer_json, "gpt2", name, eos_token_id=0, bos_token_id=0)
    write_gguf(path, {"general.architecture": ARCHITECTURE.get(name, "llama"), **metadata}, [])
    tok = poot.load(path, weights=False).tokenizer
    check_against(tok, oracle, STRESS, parse_special=(True,), exact_text=name not in NFC)


def test_poot_tokenize_reads_a_gemma4_vocabulary(tmp_path):
    tokenizer_json = gemma4_tokenizer_json()
    oracle = hf.Tokenizer.from_str(json.dumps(tokenizer_json))
    path = tmp_path / "ggml-vocab-gemma4.gguf"
    write_gguf(path, {"general.architecture": "gemma4", **gemma4_metadata(tokenizer_json)}, [])
    text = "Hello, y'all!\n\n\tHow are you 😁 ?我想在apple工作1314151天～"
    result = subprocess.run([sys.executable, "-m", "poot", "tokenize", "--model", str(path), text],
                            cwd=pathlib.Path(__file__).parent.parent, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [1] + hf_ids(oracle, text)


LLAMA_CPP_VOCABS = os.environ.get("POOT_LLAMA_CPP_VOCABS")    # llama.cpp's models/ folder


def _llama_cpp_vocabs():
    folder = pathlib.Path(LLAMA_CPP_VOCABS or "/nonexistent")
    return sorted(p for p in folder.glob("ggml-vocab-*.gguf")
                  if p.with_suffix(".gguf.inp").exists() and p.with_suffix(".gguf.out").exists())


@pytest.mark.skipif(not _llama_cpp_vocabs(), reason="POOT_LLAMA_CPP_VOCABS names no folder of "
                    "llama.cpp's ggml-vocab-*.gguf files with their .inp/.out test vectors")
def test_llama_cpp_test_vocabularies():
    """llama.cpp's test vocabularies, where a checkout's models/ folder is at hand: each .out
    line holds the ids Hugging Face's tokenizer gave its .inp text (no BOS/EOS). Vocabularies of
    a tokenizer model poot does not read (WordPiece, Unigram) are refused by name."""
    checked = []
    for path in _llama_cpp_vocabs():
        try:
            tok = poot.load(path, weights=False).tokenizer
        except TokenizerUnsupported as e:
            assert e.what in ("model", "pre-tokenizer"), e
            continue
        inputs = path.with_suffix(".gguf.inp").read_text(encoding="utf-8")
        texts = inputs.split("\n__ggml_vocab_test__\n")[:-1]
        expected = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
        for text, line in zip(texts, expected):
            ids = [int(i) for i in line.split()]
            assert tok.encode(text, add_special=False) == ids, (path.name, text)
        checked.append(path.name)
    assert checked


# -- added tokens, BOS/EOS rules -----------------------------------------------------------

def with_added(tokenizer_json, added, post_processor=None):
    tokenizer_json = json.loads(json.dumps(tokenizer_json))
    next_id = 1 + max(tokenizer_json["model"]["vocab"].values())
    for i, (content, special, lstrip, rstrip) in enumerate(added):
        tokenizer_json["added_tokens"].append({
            "id": next_id + i, "content": content, "single_word": False, "lstrip": lstrip,
            "rstrip": rstrip, "normalized": False, "special": special})
    if post_processor is not None:
        tokenizer_json["post_processor"] = post_processor
    return tokenizer_json


def test_added_tokens_like_hf():
    base = train_byte_level("llama-bpe")
    tokenizer_json = with_added(base, [("<tool_call>", False, False, False),
                                       ("<|begin_of_text|>", True, False, False),
                                       ("<|eot_id|>", True, False, False),
                                       ("[MASK]", True, True, True)])
    tok = Tokenizer.from_hf(tokenizer_json)
    oracle = hf.Tokenizer.from_str(json.dumps(tokenizer_json))
    texts = ["<tool_call>{\"a\": 1}</tool_call>", "x  [MASK]  y", "a[MASK]b", "[MASK]",
             "<|begin_of_text|>Hi<|eot_id|>", "<|eot_id|><tool_call><|eot_id|>", " <|eot_id|> "]
    check_against(tok, oracle, texts, exact_text=False)
    # user-defined (non-special) added tokens stay whole even when specials are plain text
    tool = tok.token_to_id("<tool_call>")
    assert tool in tok.encode("<tool_call>", parse_special=False)
    assert tok.token_to_id("<|eot_id|>") not in tok.encode("<|eot_id|>", parse_special=False)


def test_written_out_tokens_are_found_leftmost_then_longest():
    """_SpecialMatcher's group-free search against its rule spelled as one group an
    alternative (longest text first, lstrip/rstrip taking the whitespace beside), on random
    token sets with shared prefixes, equal texts and whitespace tokens."""
    from poot.text.tokenizer import _SPACE, _SpecialMatcher
    rng = random.Random(7)
    alphabet = "<>|ab \n\u3000"
    for _ in range(200):
        texts = ["".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(6)]
        marked = list(enumerate(texts))
        lstrip = {i for i in range(6) if rng.random() < 0.3}
        rstrip = {i for i in range(6) if rng.random() < 0.3}
        order = sorted(marked, key=lambda it: -len(it[1]))
        rule = re.compile("|".join(f"({_SPACE * (i in lstrip)}{re.escape(t)}"
                                   f"{_SPACE * (i in rstrip)})" for i, t in order))
        matcher = _SpecialMatcher(marked, lstrip, rstrip)
        for _ in range(40):
            text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
            want = [(m.start(), m.end(), order[m.lastindex - 1][0]) for m in rule.finditer(text)]
            assert list(matcher.find(text)) == want, (marked, lstrip, rstrip, text)


def test_llama3_template_adds_bos_like_hf():
    base = train_byte_level("llama-bpe")
    bos = 1 + max(base["model"]["vocab"].values())
    template = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                  {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                  {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos],
                                                  "tokens": ["<|begin_of_text|>"]}}}]}
    tokenizer_json = with_added(base, [("<|begin_of_text|>", True, False, False),
                                       ("<|eot_id|>", True, False, False)], template)
    oracle = hf.Tokenizer.from_str(json.dumps(tokenizer_json))
    tok = Tokenizer.from_hf(tokenizer_json, {"bos_token": "<|begin_of_text|>",
                                             "eos_token": "<|eot_id|>"},
                            {"eos_token_id": [bos + 1, 0]})
    assert tok.bos_id == bos and tok.eos_ids == frozenset({bos + 1, 0})
    for text in STRESS[:50]:
        assert tok.encode(text) == hf_ids(oracle, text, add_special=True)
    assert tok.encode("")[:1] == [bos]


def test_tokenizer_config_bos_eos_flags():
    base = with_added(train_byte_level("gpt2"), [("<s>", True, False, False),
                                                 ("</s>", True, False, False)])
    config = {"add_bos_token": True, "add_eos_token": True,
              "bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>"}
    tok = Tokenizer.from_hf(base, config)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert tok.encode("hi") == [bos, *tok.encode("hi", add_special=False), eos]
    assert tok.eos_ids == frozenset({eos}) and tok.special_ids >= {bos, eos}


# -- SentencePiece BPE -----------------------------------------------------------------------

SP_TRAIN = [line for text in [ENGLISH] + STRESS[:150] for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sentencepiece_model():
    spm = pytest.importorskip("sentencepiece")
    proto = io.BytesIO()
    # Llama 2's settings: BPE, byte fallback, a dummy prefix, no normalization.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_TRAIN), model_writer=proto, model_type="bpe", vocab_size=600,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2,
        hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


def sentencepiece_metadata(sp):
    def kind(i):
        return (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else
                BYTE if sp.is_byte(i) else UNUSED if sp.is_unused(i) else NORMAL)
    n = sp.get_piece_size()
    return {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


SP_TEXTS = [t for t in STRESS if "\r" not in t]   # sentencepiece's trainer input is line-based


def test_sentencepiece_gguf_matches_sentencepiece(sentencepiece_model):
    sp = sentencepiece_model
    tok = Tokenizer.from_gguf(sentencepiece_metadata(sp))
    assert tok.bos_id == 1 and tok.eos_ids == frozenset({2})
    unseen = "ꙮ 𝄞 ☃!"                 # not in the training text: spelled as byte tokens
    for text in SP_TEXTS + [ENGLISH, "\r\n", unseen]:
        ids = sp.encode(text)
        assert tok.encode(text, add_special=False, parse_special=False) == ids, repr(text)
        assert tok.encode(text, parse_special=False) == [1] + ids
        assert tok.decode(ids) == sp.decode(ids) == text.replace("▁", " ")
        assert "".join(streamed(tok, [1] + ids, skip_special=True)) == tok.decode(ids)
    assert sum(tok.token_types[i] == BYTE for i in tok.encode(unseen)) == 10


def sentencepiece_hf_json(sp, metaspace):
    """The tokenizer.json form of the same model, as the converters write it: merges in the order
    of the merged piece's score, then either Llama 2's normalizers or a Metaspace pre-tokenizer."""
    metadata = sentencepiece_metadata(sp)
    tokens, scores, types = (metadata["tokenizer.ggml." + k] for k in ("tokens", "scores",
                                                                        "token_type"))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted(((piece[:k], piece[k:], -scores[i], vocab[piece[:k]], vocab[piece[k:]])
                     for i, piece in enumerate(tokens) if types[i] == NORMAL
                     for k in range(1, len(piece))
                     if piece[:k] in vocab and piece[k:] in vocab),
                    key=lambda m: m[2:])
    special = {"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}}],
               "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                        {"Sequence": {"id": "B", "type_id": 1}}],
               "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i in range(3)],
        "post_processor": special,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b, *_ in merges]},
    }
    if metaspace:
        tokenizer_json["normalizer"] = None
        tokenizer_json["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁",
                                           "prepend_scheme": "first", "split": False}
        tokenizer_json["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
            {"type": "ByteFallback"}, {"type": "Fuse"}]}
    else:
        tokenizer_json["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        tokenizer_json["pre_tokenizer"] = None
        tokenizer_json["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return tokenizer_json


@pytest.mark.parametrize("metaspace", [False, True])
def test_sentencepiece_tokenizer_json_matches_hf(sentencepiece_model, metaspace):
    tokenizer_json = sentencepiece_hf_json(sentencepiece_model, metaspace)
    oracle = hf.Tokenizer.from_str(json.dumps(tokenizer_json))
    tok = Tokenizer.from_hf(tokenizer_json, {"bos_token": "<s>", "eos_token": "</s>"})
    texts = SP_TEXTS + ["<s>Hello</s> there", "a<unk>b", ENGLISH]
    check_against(tok, oracle, texts, exact_text=False)
    for text in texts:
        assert tok.encode(text) == hf_ids(oracle, text, add_special=True)
    if not metaspace:   # Llama 2's form is sentencepiece's own segmentation
        for text in SP_TEXTS:
            assert tok.encode(text, False, False) == sentencepiece_model.encode(text), repr(text)


def test_merge_takes_the_lowest_rank_then_the_leftmost_pair():
    ranks = {("a", "a"): 0, ("b", "c"): 1, ("aa", "b"): 2}
    rank = lambda left, right: ranks.get((left, right))    # noqa: E731
    assert merge("aaa", rank) == ["aa", "a"]
    assert merge("aaaa", rank) == ["aa", "aa"]
    assert merge("aabc", rank) == ["aa", "bc"]               # rank 1 beats rank 2
    assert merge("x", rank) == ["x"] and merge("", rank) == []


# -- streaming, decoding edge cases, refusals ------------------------------------------------

def test_streaming_holds_back_partial_characters(smollm2):
    tok, oracle = smollm2.tok, smollm2.oracle
    ids = tok.encode("é😀👨‍👩‍👧")
    pieces = streamed(tok, ids)
    assert "".join(pieces) == "é😀👨‍👩‍👧" and "\ufffd" not in "".join(pieces)
    # bytes that never complete a character: U+FFFD, exactly as a one-shot decode (and HF) give
    by_byte = {tok.token_bytes(i): i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1}
    broken = [by_byte[b"\xf0"], by_byte[b"\x9f"], by_byte[b"a"], by_byte[b"\xe2"], by_byte[b"\x82"]]
    text = tok.decode(broken)
    assert text == oracle.decode(broken) == "\ufffda\ufffd"
    pieces = streamed(tok, broken)
    assert pieces[:2] == ["", ""] and "".join(pieces) == text


def test_ids_outside_the_vocabulary_decode_to_nothing(smollm2):
    tok = smollm2.tok
    assert tok.decode([19556, tok.vocab_size + 5]) == tok.decode([19556]) == "Hello"
    with pytest.raises(IndexError):
        tok.token_bytes(-1)


def test_unsupported_tokenizers_are_refused():
    with pytest.raises(TokenizerUnsupported, match="bert"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerUnsupported, match="pre-tokenizer 'bloom'") as refused:
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "bloom",
                             "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []})
    assert refused.value.exit_status == 7
    with pytest.raises(TokenizerUnsupported, match="WordPiece"):
        Tokenizer.from_hf({"model": {"type": "WordPiece", "vocab": {"a": 0}}})
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf({})
    with pytest.raises(ModelFileError, match="merges"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
