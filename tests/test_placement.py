"""The parts of a device group (engine/placement.py), checked in numpy: the graphs of a pipeline's
stages run one after another, and a tensor group's shards run in lockstep with their partial
sums added and their slices of the logits gathered, must give the whole model's logits. No
device is needed: this is the arithmetic of the split, which the ptx group then runs
(tests/test_group.py)."""
import numpy as np
import pytest

import poot
from poot.engine import placement
from poot.errors import PlacementRefused
from poot.ir.reference import ReferenceInterpreter, run_group
from tests.models import tiny_model


def interpreter(model, part, num_blocks=16, block_size=4):
    graph = model.step_graph(num_blocks, block_size, part)
    state = {name: np.zeros(t.shape, np.float32) for name, t in graph.state.items()}
    return ReferenceInterpreter(graph, lambda name: graph.read(name, model.weight_array),
                                state)


def steps(rng, vocab):
    """A prefill of two sequences (7 and 5 tokens), then two decode steps of both."""
    tables = np.array([[3, 9, 0, 12], [5, 1, 14, 7]], np.int32)
    yield {"tokens": rng.integers(0, vocab, 12, dtype=np.int32),
           "positions": np.r_[np.arange(7), np.arange(5)].astype(np.int32),
           "seq_rows": np.r_[np.zeros(7), np.ones(5)].astype(np.int32),
           "block_tables": tables, "sample_tokens": np.array([6, 11], np.int32)}
    for n in range(2):
        yield {"tokens": rng.integers(0, vocab, 2, dtype=np.int32),
               "positions": np.array([7 + n, 5 + n], np.int32),
               "seq_rows": np.array([0, 1], np.int32), "block_tables": tables,
               "sample_tokens": np.array([0, 1], np.int32)}


MODELS = {"llama-f16": ("tiny", "F16", "llama"), "odd-q4_0": ("tiny-odd", "Q4_0", "llama"),
          "qwen2-f32": ("tiny", "F32", "qwen2"), "qwen3-f16": ("tiny", "F16", "qwen3"),
          "tied-q4_0": ("tiny-odd", "Q4_0", "llama", True)}
# (model, devices): tiny has 2 layers and 2 KV heads; tiny-odd 3 of each (uneven at 2); the
# vocabulary of 320 splits unevenly over 3
GROUPS = [("llama-f16", 2), ("odd-q4_0", 2), ("odd-q4_0", 3), ("qwen2-f32", 2), ("qwen3-f16", 2),
          ("tied-q4_0", 2), ("tied-q4_0", 3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m")
    return {key: poot.load(tiny_model(folder, dtype=dtype, arch=arch, shape=shape,
                                      tied=bool(tied)))
            for key, (shape, dtype, arch, *tied) in MODELS.items()}


def whole_logits(model):
    one = interpreter(model, None)
    return [one.run(inputs)["logits"] for inputs in steps(np.random.default_rng(1),
                                                           model.config.vocab_size)]


@pytest.mark.parametrize("key,world", GROUPS)
def test_tensor_shards_sum_to_the_whole_model(models, key, world):
    model = models[key]
    cfg = model.config
    parts = placement.tensor_parts(cfg, model.weight_shapes(), world)
    assert sum(b - a for a, b in (p.kv_heads for p in parts)) == cfg.n_kv_heads
    assert sum(b - a for a, b in (p.ff for p in parts)) == cfg.d_ff
    assert [p.logits for p in parts] == [True] + [False] * (world - 1)
    ranks = [interpreter(model, p) for p in parts]
    want = whole_logits(model)
    for inputs, expected in zip(steps(np.random.default_rng(1), cfg.vocab_size), want):
        outputs = run_group(ranks, [inputs] * world)
        assert "logits" in outputs[0] and all("logits" not in o for o in outputs[1:])
        np.testing.assert_allclose(outputs[0]["logits"], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key,world", GROUPS)
def test_tensor_ranks_split_the_output_head(models, key, world):
    """Each rank holds and computes its rows of the output head, rank 0 gathers them; a tied
    head (the embedding table, held whole by every rank) stays whole on rank 0."""
    model = models[key]
    cfg = model.config
    parts = placement.tensor_parts(cfg, model.weight_shapes(), world)
    graphs = [model.step_graph(16, 4, p) for p in parts]
    gathers = [[op for op in g.ops if op.kind == "all_gather"] for g in graphs]
    if cfg.tied_embeddings:
        assert all(p.vocab is None for p in parts)
        assert [p.last for p in parts] == [True] + [False] * (world - 1)
        assert not any(gathers)
        return
    vocab = [p.vocab for p in parts]
    assert vocab[0][0] == 0 and vocab[-1][1] == cfg.vocab_size
    assert [a for a, _ in vocab[1:]] == [b for _, b in vocab[:-1]]
    assert max(b - a for a, b in vocab) - min(b - a for a, b in vocab) <= 1
    assert all(p.last for p in parts)
    for p, g, ops in zip(parts, graphs, gathers):
        assert g.weights["output.weight"].shape == (p.vocab[1] - p.vocab[0], cfg.d_model)
        assert len(ops) == 1 and ops[0].output.shape == ("R", cfg.vocab_size)
        assert p.describe()["vocab_rows"] == list(p.vocab)


@pytest.mark.parametrize("key,stages", GROUPS)
def test_pipeline_stages_chain_to_the_whole_model(models, key, stages):
    model = models[key]
    cfg = model.config
    parts = placement.pipeline_parts(cfg, stages, 10, 3, 3)
    assert [p.layers[0] for p in parts[1:]] == [p.layers[1] for p in parts[:-1]]
    assert parts[0].layers[0] == 0 and parts[-1].layers[1] == cfg.n_layers
    chain = [interpreter(model, p) for p in parts]
    want = whole_logits(model)
    for inputs, expected in zip(steps(np.random.default_rng(1), cfg.vocab_size), want):
        hidden = None
        for stage in chain:
            out = stage.run(dict(inputs, hidden=hidden) if hidden is not None else inputs)
            hidden = out.get("hidden")
        np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-5)


def test_pipeline_balances_the_stages_bytes():
    cfg = type("Cfg", (), {"n_layers": 32})
    # an output head of 3 layers' bytes and an embedding of 1: the last stage takes fewer layers
    parts = placement.pipeline_parts(cfg, 2, 100, 100, 300)
    assert [p.layers for p in parts] == [(0, 17), (17, 32)]
    parts = placement.pipeline_parts(cfg, 4, 100, 0, 0)
    assert [p.layers for p in parts] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert [(p.first, p.last) for p in parts] == [(True, False), (False, False),
                                                  (False, False), (False, True)]


def test_groups_larger_than_the_model_allows_are_refused(tmp_path):
    model = poot.load(tiny_model(tmp_path, dtype="F16"))     # 2 layers, 2 KV heads
    with pytest.raises(PlacementRefused, match="2 KV heads"):
        placement.tensor_parts(model.config, model.weight_shapes(), 3)
    with pytest.raises(PlacementRefused, match="2 layers"):
        placement.pipeline_parts(model.config, 3, 1, 0, 0)


def test_tensor_split_inside_a_quant_block_is_refused(tmp_path):
    # tiny-odd in Q4_K: 256-column blocks, and the first split falls at column 64
    model = poot.load(tiny_model(tmp_path, dtype="F16", shape="tiny-odd"))
    shapes = {name: (shape, "Q4_K" if name.endswith("attn_output.weight") else dtype)
              for name, (shape, dtype) in model.weight_shapes().items()}
    with pytest.raises(PlacementRefused, match="blocks of 256"):
        placement.tensor_parts(model.config, shapes, 2)
