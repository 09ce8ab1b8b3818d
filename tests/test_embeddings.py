"""Embeddings: what the engine's embed requests read, and /v1/embeddings over HTTP with the
openai client (devices: tests/test_device_runner.py)."""
import base64

import numpy as np
import openai
import pytest

import poot
from poot.engine.engine import Engine
from poot.engine.request import SamplingParams
from tests.models import tiny_model
from tests.test_serve import start_server

EMBED = SamplingParams(temperature=0.0, embed=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return poot.load(tiny_model(tmp_path_factory.mktemp("tiny"), dtype="F16"))


def prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, n).tolist() for n in lengths]


def embed_all(engine, prompt_list, generating=()):
    """The hidden states of embed requests run together with generating ones."""
    gen = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    others = [engine.submit(p, gen) for p in generating]
    handles = [engine.submit(p, EMBED) for p in prompt_list]
    engine.run_until_idle()
    for h in others:
        assert list(h)[-1].finish_reason == "length"
    outs = [list(h) for h in handles]
    assert all(len(out) == 1 and out[0].token_ids == [] for out in outs)
    return [out[0] for out in outs]


def test_last_hidden_is_what_the_head_reads(model):
    """The reference runner's last_hidden, normed by the output norm and multiplied by the
    head, gives the same step's logits; its embedding is that normed state at unit length."""
    runner = model.runner(None, num_blocks=64, block_size=4)
    engine = Engine(runner, model.tokenizer, max_seqs=4, step_tokens=16)
    prompt = prompts(1, [11])[0]
    hidden = embed_all(engine, [prompt])[0].hidden
    logits = Engine(model.runner(None, num_blocks=64, block_size=4), model.tokenizer)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
    top = list(logits.generate(prompt, first))[0].logprobs[0].top
    cfg = model.config
    normed = hidden / np.sqrt(np.mean(hidden.astype(np.float64) ** 2) + cfg.norm_eps) \
        * model.weight_array("output_norm.weight")
    head = model.weight_array("token_embd.weight" if cfg.tied_embeddings else "output.weight")
    mine = normed @ head.T
    mine = mine - mine.max() - np.log(np.exp(mine - mine.max()).sum())
    for token, logprob in top:
        assert abs(mine[token] - logprob) < 1e-3
    want = normed / np.linalg.norm(normed)
    assert np.allclose(model.embedding(hidden), want, atol=1e-6)


def test_embeddings_over_http(model):
    server = start_server(model)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        texts = ["The quick brown fox", "jumps over the lazy dog", "The quick brown fox"]
        got = client.embeddings.create(model=model.name, input=texts)
        vectors = np.array([d.embedding for d in got.data])
        assert [d.index for d in got.data] == [0, 1, 2]
        assert vectors.shape == (3, model.config.d_model)
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
        assert np.allclose(vectors[0], vectors[2], atol=1e-6)
        assert not np.allclose(vectors[0], vectors[1], atol=1e-3)
        n_tokens = sum(len(model.tokenizer.encode(t, add_special=True)) for t in texts)
        assert got.usage.prompt_tokens == got.usage.total_tokens == n_tokens
        ids = model.tokenizer.encode(texts[1], add_special=True, parse_special=True)
        one = client.embeddings.create(model=model.name, input=ids)
        assert np.allclose(one.data[0].embedding, vectors[1], atol=1e-6)
        raw = client.embeddings.create(model=model.name, input=texts[0],
                                       encoding_format="base64")
        # the client decodes base64 itself where numpy is installed: accept both shapes
        values = raw.data[0].embedding
        if isinstance(values, str):
            values = np.frombuffer(base64.b64decode(values), "<f4")
        assert np.allclose(values, vectors[0], atol=1e-6)
        short = client.embeddings.create(model=model.name, input=texts[0], dimensions=8)
        cut = vectors[0][:8] / np.linalg.norm(vectors[0][:8])
        assert np.allclose(short.data[0].embedding, cut, atol=1e-5)
        # a request with a bad input queues none of its inputs (the engine's own submit,
        # counted): nothing of it is left for the engine to drop after the 400
        submitted, submit = [], server.engine.submit_prompts
        server.engine.submit_prompts = lambda *a, **k: (submitted.append(a), submit(*a, **k))[1]
        for bad, param in (({"input": ""}, "input"), ({"input": []}, "input"),
                           ({"input": [1.5]}, "input"), ({"input": "a", "dimensions": 0},
                                                         "dimensions"),
                           ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                           ({"input": [[1, 2], [9999999]]}, "input")):
            with pytest.raises(openai.BadRequestError) as e:
                client.post("/embeddings", body={"model": model.name, **bad}, cast_to=object)
            assert e.value.body["param"] == param, (bad, e.value.body)
        assert submitted == [] and server.engine.kv.num_used == 0
    finally:
        server.close(grace=0)
