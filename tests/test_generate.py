"""Generation end to end on the reference backend: the library API and the `poot` command."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import poot
from tests.models import default_model, tiny_model

ROOT = Path(__file__).resolve().parent.parent


def poot_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "poot", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def smollm():
    return poot.LLM(default_model(), backend="reference", context=1024)


def test_default_model_knows_the_capital_of_france(smollm):
    out = smollm.generate("The capital of France is", max_tokens=8, temperature=0)
    assert out.text.lstrip().startswith("Paris"), out.text
    again = smollm.generate("The capital of France is", max_tokens=8, temperature=0)
    assert again.token_ids == out.token_ids


def test_default_model_answers_a_chat_question(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      max_tokens=32, temperature=0)
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_seeded_sampling_reproduces_and_stop_strings_cut(smollm):
    a = smollm.generate("Once upon a time", max_tokens=12, temperature=0.9, seed=5)
    b = smollm.generate("Once upon a time", max_tokens=12, temperature=0.9, seed=5)
    assert a.token_ids == b.token_ids and a.text == b.text
    cut = smollm.generate("The capital of France is", max_tokens=8, temperature=0, stop=["."])
    assert cut.finish_reason == "stop" and "." not in cut.text


def test_stream_pieces_make_the_text(smollm):
    pieces = list(smollm.stream("The capital of France is", max_tokens=8, temperature=0))
    assert "".join(pieces) == smollm.generate("The capital of France is", max_tokens=8,
                                              temperature=0).text


def test_prompts_and_choices_run_together_as_each_alone(smollm):
    """A list of prompts (text and token ids) in one call, run together, gives each prompt's
    answer alone; n choices sample as n calls with seeds seed, seed + 1, ...; with max_seqs 1
    the choices wait their turn and give the same."""
    batched = poot.LLM(default_model(), backend="reference", context=256, max_seqs=4)
    ids = smollm.prompt_ids("Water boils at")
    prompts = ["The capital of France is", "Once upon a time", ids]
    got = batched.generate(prompts, max_tokens=8, temperature=0)
    assert [g.token_ids for g in got] == [
        smollm.generate(p, max_tokens=8, temperature=0).token_ids for p in prompts]
    assert got[2].prompt_token_ids == ids and all(g.finish_reason == "length" for g in got)
    for llm in (batched, smollm):
        choices = llm.generate("Once upon a time", n=3, max_tokens=6, temperature=1.0, seed=7)
        assert [c.token_ids for c in choices] == [
            smollm.generate("Once upon a time", max_tokens=6, temperature=1.0,
                            seed=7 + j).token_ids for j in range(3)]
    two = batched.generate(prompts[:2], n=2, max_tokens=4, temperature=0)
    assert [[c.token_ids for c in pair] for pair in two] == \
        [[g.token_ids[:4]] * 2 for g in got[:2]]
    chats = batched.chat([{"role": "user", "content": "Hi"}], n=2, max_tokens=4, temperature=0)
    assert len(chats) == 2 and chats[0].token_ids == chats[1].token_ids
    with pytest.raises(poot.UsageError, match="max_seqs"):
        poot.LLM(default_model(), backend="reference", max_seqs=0)


def test_chat_template_kwargs_reach_the_template(tmp_path):
    """LLM.chat's chat_template_kwargs: Qwen3's template, told enable_thinking false, ends the
    prompt with an empty think block."""
    from tests.test_serve_tools import long_tiny
    llm = poot.LLM(long_tiny(tmp_path, "qwen3-0.6b").file.path, backend="reference")
    ask = [{"role": "user", "content": "Hi"}]
    thinking = llm.chat_prompt_ids(ask)
    quiet = llm.chat_prompt_ids(ask, {"enable_thinking": False})
    assert llm.tokenizer.decode(quiet) == llm.tokenizer.decode(thinking) + \
        "<think>\n\n</think>\n\n"
    done = llm.chat(ask, chat_template_kwargs={"enable_thinking": False}, max_tokens=2,
                    temperature=0, ignore_eos=True)
    assert done.prompt_token_ids == quiet and len(done.token_ids) == 2


def test_cli_generate_json(tmp_path):
    model = tiny_model(tmp_path)
    result = poot_cli("generate", "--model", str(model), "--prompt", "Hello", "--max-tokens",
                      "5", "--temperature", "0", "--backend", "reference", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
    assert out["prompt_token_ids"] == poot.load(model).tokenizer.encode("Hello")
    llm = poot.LLM(model, backend="reference")
    assert llm.generate("Hello", max_tokens=5, temperature=0).token_ids == out["token_ids"]


def test_cli_generate_refuses_backends_that_cannot_open(tmp_path):
    model = tiny_model(tmp_path)
    for backend, status in (("rocm", 3), ("nonsense", 2)):
        result = poot_cli("generate", "--model", str(model), "--prompt", "x", "--backend",
                          backend)
        assert result.returncode == status, result.stderr
        assert result.stderr.count("\n") == 1 and backend in result.stderr


def test_cli_tokenize_one_text_and_stdin_lines(tmp_path):
    model = tiny_model(tmp_path)
    tok = poot.load(model).tokenizer
    one = poot_cli("tokenize", "--model", str(model), "Hi <|im_start|>")
    assert json.loads(one.stdout) == tok.encode("Hi <|im_start|>")
    lines = ["Hello", "<|im_end|> x", "naïve 123"]
    many = poot_cli("tokenize", "--model", str(model), "--no-special",
                    stdin="".join(json.dumps(s) + "\n" for s in lines))
    assert [json.loads(x) for x in many.stdout.splitlines()] == [
        tok.encode(s, parse_special=False) for s in lines]
    assert 2 not in json.loads(many.stdout.splitlines()[1])      # <|im_end|> stayed text


def test_tokenizing_needs_no_weights(tmp_path):
    """A file holding a vocabulary alone (as llama.cpp's ggml-vocab-*.gguf do), of an
    architecture poot does not run: `poot tokenize` and `chat-template` read it; loading it as
    a model says what is missing."""
    from poot.errors import ModelFileError
    from poot.formats.gguf import GGUFFile, write_gguf
    model = tiny_model(tmp_path)
    meta = {k: v for k, v in GGUFFile(model).metadata.items()
            if k.startswith("tokenizer.") or k == "general.alignment"}
    vocab = tmp_path / "vocab-only.gguf"
    write_gguf(vocab, {"general.architecture": "gemma4", **meta}, [])
    one = poot_cli("tokenize", "--model", str(vocab), "Hi <|im_start|>")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout) == poot.load(model).tokenizer.encode("Hi <|im_start|>")
    chat = poot_cli("chat-template", "--model", str(vocab),
                    stdin='[{"role": "user", "content": "Hi"}]')
    assert chat.stdout == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ModelFileError, match="architecture 'gemma4' is not supported"):
        poot.load(vocab)


def test_cli_chat_template(tmp_path):
    model = tiny_model(tmp_path)
    result = poot_cli("chat-template", "--model", str(model),
                      stdin='[{"role": "user", "content": "Hi"}]')
    assert result.stdout == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_bad_model_file_exits_7_naming_the_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 10)
    result = poot_cli("generate", "--model", str(bad), "--prompt", "x", "--backend",
                      "reference")
    assert result.returncode == 7 and str(bad) in result.stderr
