"""The Phi-3 family graph, interpreted by the reference, against Hugging Face transformers.

Tiny random Phi3ForCausalLM models of each variant (plain, LongRoPE with its long or its short
factors, partial rotary with tied embeddings, a sliding window) are saved as safetensors and
written again as llama.cpp's converter lays out a GGUF (fused attn_qkv and ffn_up, LongRoPE's
factors as tensors and its attention factor as metadata); both load here and give
transformers' logits. Quantised files with fused tensors give the logits of transformers run on
their dequantised weights, and a tensor group's shards of the fused tensors sum to the whole.
"""
import dataclasses
import json

import numpy as np
import pytest

import poot
from poot.backends.ptx import PtxGroup
from poot.engine import placement
from poot.engine.group import GroupRunner
from poot.errors import BackendUnavailable, ModelFileError, NoSuchDevice
from poot.formats import open_model
from poot.formats.gguf import write_gguf
from poot.ir.reference import ReferenceInterpreter, run_group
from poot.models import family, phi3
from poot.models.random_weights import PHI3_CHAT, PHI3_SPECIALS, byte_level_metadata, \
    byte_level_vocab, write_random_phi3
from poot.text.chat import ChatTemplate
from tests import test_llama
from tests.conftest import open_or_skip
from tests.test_chat import TEMPLATES
from tests.test_device_runner import greedy, prefill_of
from tests.test_group import OneDeviceGroup, same_greedy
from tests.test_llama import BLOCK, hf_logits, rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 320                     # room for the byte-level tokenizer of the GGUF copies


def hf_model(tmp_path, **extra):
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=0, eos_token_id=0)
    common.update(extra)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common)).eval()
    with torch.no_grad():                     # norms away from 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp_path / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return model, folder


def write_tokenizer(folder):
    """A byte-level BPE tokenizer.json with Phi-3's special tokens, its EOS <|endoftext|>."""
    tokens, merges = byte_level_vocab(VOCAB, specials=PHI3_SPECIALS)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(PHI3_SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "add_bos_token": False, "chat_template": PHI3_CHAT}))


def longrope(pairs, original, rng, **more):
    """Config arguments of LongRoPE with random factors (short ones near 1, long ones up to
    10) for an `original` context (transformers takes it from the top level)."""
    return {"original_max_position_embeddings": original, "rope_scaling": {
        "rope_type": "longrope", "original_max_position_embeddings": original,
        "short_factor": (1 + rng.random(pairs)).tolist(),
        "long_factor": (1 + 9 * rng.random(pairs)).tolist(), **more}}


class Harness(test_llama.Harness):
    """test_llama's paged-cache harness on a given graph."""

    def __init__(self, graph, weight, num_blocks=64):
        self.graph = graph
        state = {n: np.full(t.shape, np.nan, np.float32) for n, t in graph.state.items()}
        self.interp = ReferenceInterpreter(graph, lambda name: graph.read(name, weight), state)
        self.free = list(np.random.default_rng().permutation(num_blocks))
        self.tables = {}




def gguf_copy(model, folder, path, dtype="F32"):
    """The model written as llama.cpp's converter writes a phi3 GGUF: the same (fused)
    tensors under GGUF names, LongRoPE's factors as tensors, its attention factor (the one
    transformers computed) and the original context as metadata."""
    hf = model.config
    rope = hf.rope_parameters
    head_dim = hf.hidden_size // hf.num_attention_heads
    f = open_model(folder)
    tensors = [(phi3.gguf_name(n), dtype if len(f.tensors[n].shape) == 2 else "F32",
                f.array(n)) for n in f.tensors if phi3.gguf_name(n)]
    meta = {"general.architecture": "phi3", "phi3.block_count": hf.num_hidden_layers,
            "phi3.context_length": hf.max_position_embeddings,
            "phi3.embedding_length": hf.hidden_size,
            "phi3.feed_forward_length": hf.intermediate_size,
            "phi3.attention.head_count": hf.num_attention_heads,
            "phi3.attention.head_count_kv": hf.num_key_value_heads,
            "phi3.attention.layer_norm_rms_epsilon": hf.rms_norm_eps,
            "phi3.rope.freq_base": rope["rope_theta"],
            "phi3.rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 1)),
            "phi3.attention.sliding_window": hf.sliding_window or 0,
            **byte_level_metadata(VOCAB, PHI3_SPECIALS, PHI3_CHAT, eos=0)}
    if rope["rope_type"] == "longrope":
        meta["phi3.rope.scaling.original_context_length"] = \
            rope["original_max_position_embeddings"]
        meta["phi3.rope.scaling.attn_factor"] = float(model.model.rotary_emb.attention_scaling)
        tensors += [("rope_factors_long.weight", "F32", np.array(rope["long_factor"])),
                    ("rope_factors_short.weight", "F32", np.array(rope["short_factor"]))]
    write_gguf(path, meta, tensors)
    return path


def loaded_harness(path, num_blocks=64):
    """The harness on a file (or folder) as poot.load reads it."""
    model = poot.load(path)
    return Harness(model.step_graph(num_blocks, BLOCK), model.weight_array, num_blocks), model


def variants():
    rng = np.random.default_rng()
    return {
        "plain": (dict(), 40),
        # a prompt past the original context: transformers takes the long factors, as poot
        # does for a context (256) past it
        "longrope-long": (longrope(8, 32, rng), 40),
        # the context is the original one: the short factors, with a given attention factor
        "longrope-short": (dict(max_position_embeddings=64,
                                **longrope(8, 64, rng, attention_factor=1.3)), 30),
        # Phi-4-mini's switches: 3/4 of each head rotated, tied embeddings, LongRoPE
        "partial-tied": (dict(partial_rotary_factor=0.75, tie_word_embeddings=True,
                              **longrope(6, 32, rng)), 40),
        "window": (dict(sliding_window=48), 40),
    }


@pytest.mark.parametrize("variant", list(variants()))
def test_whole_prompt_matches_transformers_from_both_formats(tmp_path, variant):
    extra, n = variants()[variant]
    model, folder = hf_model(tmp_path, **extra)
    ids = np.random.default_rng().integers(0, VOCAB, n).tolist()
    want = hf_logits(model, ids)
    harness, hf_loaded = loaded_harness(folder)
    cfg = hf_loaded.config
    assert hf_loaded.tokenizer.eos_ids == {0, PHI3_SPECIALS.index("<|end|>")}
    assert rel_err(harness.run([(0, 0, ids)]), want) < 1e-4
    rope = extra.get("rope_scaling")
    if rope:                                # the factors transformers took for this prompt
        assert cfg.rope_factors == tuple(rope["long_factor" if n > rope[
            "original_max_position_embeddings"] else "short_factor"])
    harness, loaded = loaded_harness(gguf_copy(model, folder, tmp_path / "m.gguf"))
    assert rel_err(harness.run([(0, 0, ids)]), want) < 1e-4
    gguf, hf = dataclasses.asdict(loaded.config), dataclasses.asdict(cfg)
    for name, value in hf.items():          # GGUF holds f32; its factors are a tensor
        if name not in ("rope_factors", "rope_factors_tensor"):
            assert gguf[name] == (pytest.approx(value, rel=1e-6) if isinstance(value, float)
                                  else value), name
    assert loaded.context_length == (48 if variant == "window" else
                                     model.config.max_position_embeddings)


def test_config_readers_choose_longrope_factors_by_the_context():
    """Long factors where the context exceeds the original one, short ones where it does not;
    the attention factor given, else sqrt(1 + ln(s) / ln(original)) of the scale s."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}
    base = dict(architectures=["Phi3ForCausalLM"], hidden_size=8, num_attention_heads=2,
                num_hidden_layers=1, intermediate_size=8, vocab_size=10)
    long = phi3.config_from_hf("x", dict(base, max_position_embeddings=4096,
                                         original_max_position_embeddings=1024,
                                         rope_scaling=rope))
    assert long.rope_factors == (3.0, 4.0)
    assert long.attn_factor == pytest.approx(np.sqrt(1 + np.log(4) / np.log(1024)))
    short = phi3.config_from_hf("x", dict(base, max_position_embeddings=1024,
                                          original_max_position_embeddings=1024,
                                          rope_scaling=rope))
    assert short.rope_factors == (1.0, 2.0) and short.attn_factor == 1.0
    windowed = phi3.config_from_hf("x", dict(base, max_position_embeddings=4096,
                                             original_max_position_embeddings=1024,
                                             sliding_window=1000, rope_scaling=rope))
    assert windowed.context_length == 1000 and windowed.rope_factors == (1.0, 2.0)
    meta = {"general.architecture": "phi3", "phi3.block_count": 1, "phi3.context_length": 4096,
            "phi3.embedding_length": 8, "phi3.feed_forward_length": 8,
            "phi3.attention.head_count": 2, "phi3.attention.layer_norm_rms_epsilon": 1e-5,
            "phi3.rope.scaling.original_context_length": 1024, "phi3.vocab_size": 10}
    names = {"rope_factors_long.weight", "rope_factors_short.weight", "output.weight"}
    cfg = phi3.config_from_gguf("x", meta, names)
    assert cfg.rope_factors_tensor == "rope_factors_long.weight"
    assert cfg.attn_factor == pytest.approx(long.attn_factor)       # no key: the paper's rule
    cfg = phi3.config_from_gguf("x", dict(meta, **{"phi3.attention.sliding_window": 1000}),
                                names)
    assert cfg.context_length == 1000 and cfg.rope_factors_tensor == "rope_factors_short.weight"
    with pytest.raises(ModelFileError, match="yarn"):
        phi3.config_from_hf("x", dict(base, max_position_embeddings=64,
                                      rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def test_chunked_prefill_decode_and_batching_match(tmp_path):
    """Two sequences share one paged cache (LongRoPE, partial rotary, a GGUF with fused
    tensors): prefill in uneven chunks, then decode together."""
    rng = np.random.default_rng()
    model, folder = hf_model(tmp_path, partial_rotary_factor=0.75, **longrope(6, 16, rng))
    harness, _ = loaded_harness(gguf_copy(model, folder, tmp_path / "m.gguf"))
    a, b = rng.integers(0, VOCAB, 23).tolist(), rng.integers(0, VOCAB, 21).tolist()
    got = {0: [], 1: []}
    got[0].append(harness.run([(0, 0, a[:9])]))
    out = harness.run([(0, 9, a[9:20]), (1, 0, b[:6])])
    got[0].append(out[:11]), got[1].append(out[11:])
    out = harness.run([(1, 6, b[6:19]), (0, 20, a[20:21])])
    got[1].append(out[:13]), got[0].append(out[13:])
    for i in range(2):
        out = harness.run([(0, 21 + i, a[21 + i:22 + i]), (1, 19 + i, b[19 + i:20 + i])])
        got[0].append(out[:1]), got[1].append(out[1:])
    assert rel_err(np.concatenate(got[0]), hf_logits(model, a)) < 1e-4
    assert rel_err(np.concatenate(got[1]), hf_logits(model, b)) < 1e-4


HF_NAMES = {g: h for h, g in family.HF_NAMES.items()}


def hf_of_gguf(model):
    """transformers' Phi3ForCausalLM holding a loaded GGUF phi3's weights, dequantised."""
    cfg = model.config
    config = transformers.Phi3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=512,
        original_max_position_embeddings=64,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tied_embeddings,
        partial_rotary_factor=cfg.rope_dim / cfg.head_dim, pad_token_id=0,
        rope_scaling=None if cfg.rope_factors_tensor is None else {
            "rope_type": "longrope", "original_max_position_embeddings": 64,
            "long_factor": model.weight_array("rope_factors_long.weight").tolist(),
            "short_factor": model.weight_array("rope_factors_short.weight").tolist(),
            "attention_factor": cfg.attn_factor})
    hf = transformers.Phi3ForCausalLM(config).eval()
    layer = {g: h for h, g in phi3.HF_LAYER_NAMES.items()}
    state = {}
    for name in model.weight_shapes():
        if name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            state[f"model.layers.{i}.{layer[rest]}"] = model.weight_array(name)
        elif name in HF_NAMES:
            state[HF_NAMES[name]] = model.weight_array(name)
    if cfg.tied_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    return hf


@pytest.mark.parametrize("dtype", ["Q8_0", "Q4_0"])
def test_quantised_fused_tensors_match_transformers_on_their_dequantised_weights(tmp_path,
                                                                              dtype):
    path = write_random_phi3(tmp_path / "q.gguf", "tiny-k", dtype=dtype, longrope=True,
                             rope_dim=48, tied=True, seed=int(np.random.default_rng().integers(99)))
    harness, model = loaded_harness(path)
    assert model.file.tensors["blk.0.attn_qkv.weight"].dtype == dtype
    ids = np.random.default_rng().integers(0, VOCAB, 80).tolist()   # past the original 64
    assert rel_err(harness.run([(0, 0, ids)]), hf_logits(hf_of_gguf(model), ids)) < 1e-4


def test_fused_tensors_are_read_as_slices_of_one_file_tensor(tmp_path):
    model = poot.load(write_random_phi3(tmp_path / "m.gguf"))
    graph = model.step_graph(4, BLOCK)
    H, Hkv, D, F = 4, 2, 16, 128
    slices = {n: graph.file_slice(n) for n in graph.weights if n.startswith("blk.0.")}
    assert (slices["blk.0.attn_q.weight"].tensor == slices["blk.0.attn_k.weight"].tensor
            == slices["blk.0.attn_v.weight"].tensor == "blk.0.attn_qkv.weight")
    assert [slices[f"blk.0.attn_{x}.weight"].rows for x in "qkv"] == [
        (0, H * D), (H * D, (H + Hkv) * D), ((H + Hkv) * D, (H + 2 * Hkv) * D)]
    assert [slices[f"blk.0.ffn_{x}.weight"].rows for x in ("gate", "up")] == [(0, F), (F, 2 * F)]
    assert slices["blk.0.ffn_down.weight"].rows is None
    whole = model.weight_array("blk.0.ffn_up.weight")
    assert np.array_equal(graph.read("blk.0.ffn_gate.weight", model.weight_array), whole[:F])


@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_tensor_shards_of_fused_tensors_sum_to_the_whole_model(tmp_path, dtype, world):
    """Each rank reads its KV heads' rows of q, of k and of v, and its columns' rows of gate
    and of up, from the one fused tensor; the group's logits are the whole model's."""
    model = poot.load(write_random_phi3(tmp_path / "m.gguf", "tiny-k" if dtype != "F16"
                                        else "tiny", dtype=dtype, longrope=True))
    parts = placement.tensor_parts(model.config, model.weight_shapes(), world)

    def interpreter(part):
        graph = model.step_graph(16, 4, part)
        state = {n: np.zeros(t.shape, np.float32) for n, t in graph.state.items()}
        return ReferenceInterpreter(graph, lambda n: graph.read(n, model.weight_array), state)

    inputs = {"tokens": np.random.default_rng().integers(0, VOCAB, 9, dtype=np.int32),
              "positions": np.arange(9, dtype=np.int32), "seq_rows": np.zeros(9, np.int32),
              "block_tables": np.array([[3, 1, 7]], np.int32),
              "sample_tokens": np.array([8], np.int32)}
    want = interpreter(None).run(inputs)["logits"]
    got = run_group([interpreter(p) for p in parts], [inputs] * world)[0]["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["phi-3-mini-4k-instruct", "phi-3.5-mini-instruct"])
def test_chat_templates_render_and_end_of_turn_ends_generation(tmp_path, name):
    """Phi-3's own chat templates render through poot's; <|end|>, which closes each turn,
    ends generation although the file names <|endoftext|> as EOS."""
    path = write_random_phi3(tmp_path / "m.gguf")
    llm = poot.LLM(path, backend="reference")
    end = llm.tokenizer.token_to_id("<|end|>")
    assert llm.tokenizer.eos_ids == {0, end}
    template = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), bos_token="<s>",
                            eos_token="<|endoftext|>")
    text = template.render([{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello"},
                            {"role": "user", "content": "Again"}], add_generation_prompt=True)
    assert "<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n" in text
    assert text.endswith("<|user|>\nAgain<|end|>\n<|assistant|>\n")
    ids = llm.tokenizer.encode(text, add_special=False, parse_special=True)
    assert ids.count(end) == 3
    out = llm.generate(ids, max_tokens=8, temperature=0, logit_bias={end: 100})
    assert out.finish_reason == "stop" and out.text == ""
    out = llm.generate(ids, max_tokens=8, temperature=0, logit_bias={end: -100})
    assert out.finish_reason == "length" and len(out.token_ids) == 8


# On the devices (tests/conftest.py's `device`: each backend that opens here)
DEVICE_MODELS = {
    "plain-f16": ("tiny", "F16", {}),
    # Phi-4-mini's switches on a quantised file: LongRoPE, 3/4 of each head rotated, tied
    "phi4mini-q8_0": ("tiny-k", "Q8_0", dict(longrope=True, rope_dim=48, tied=True)),
    "longrope-q4_0": ("tiny-k", "Q4_0", dict(longrope=True)),
    "window-bf16": ("tiny", "BF16", dict(window=100)),
    "longrope-f16-partial": ("tiny", "F16", dict(longrope=True, rope_dim=12)),
}


def device_model(folder, key):
    shape, dtype, options = DEVICE_MODELS[key]
    return poot.load(write_random_phi3(folder / f"{key}.gguf", shape, dtype=dtype, **options))


@pytest.mark.parametrize("key", list(DEVICE_MODELS))
def test_device_runner_gives_the_reference_tokens(tmp_path, device, key):
    """Greedy decoding after a prompt: the fused tensors' slices uploaded as their own (or
    stacked) weights, the scaled rope, the KV cache in f16."""
    model = device_model(tmp_path, key)
    blocks = -(-model.context_length // 16)      # the window model serves 100 tokens
    table = list(np.random.default_rng().permutation(32)[:blocks])
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 16, table)
    got_ids, got = greedy(model.runner(device, num_blocks=32), [5, 80, 9, 41], 16, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("n", [20, 130])
def test_device_prefill_matches_reference(tmp_path, device, n):
    """A long prompt step (matmuls over groups of tokens, or mma_tiled on matrix
    instructions, reading the fused tensors' row slices)."""
    model = device_model(tmp_path, "phi4mini-q8_0")
    batch = prefill_of(n)
    want = model.runner(None, num_blocks=32).logits(batch)
    got = model.runner(device, num_blocks=32, max_tokens=256).logits(batch)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_a_phi3_layer_is_six_launches_like_a_llama_layer(tmp_path, device):
    """The three slices of attn_qkv stack back into one q/k/v weight, gate and up (the halves
    of ffn_up) are one matmul with SwiGLU; the rope with LongRoPE's factor is one kernel with
    store_kv."""
    model = device_model(tmp_path, "longrope-q4_0")
    runner = model.runner(device, num_blocks=32)
    launches = [s.kind for s in runner.steps if s.kind != "reshape"]
    layer = ["matmul", "rope_store_kv", "attention", "matmul", "matmul", "matmul"]
    assert launches == ["embedding", *layer * model.config.n_layers, "gather", "matmul"]
    weights = [a.name for a in runner.allocations() if a.kind == "weights"]
    assert "blk.0.attn_q.weight+blk.0.attn_k.weight+blk.0.attn_v.weight:quants" in weights
    assert any(k.name.startswith("rope_store_kv_neox_x") for k in runner._kernels())


GROUP_MODELS = ["longrope-f16-partial", "phi4mini-q8_0"]


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
@pytest.mark.parametrize("key", GROUP_MODELS)
def test_group_parts_on_one_device_equal_the_whole_model(tmp_path, kind, key):
    """A group's runners (tests/test_group.py's OneDeviceGroup: two ranks on lavapipe): each
    tensor rank uploads its KV heads' rows of attn_qkv's q, k and v parts and its columns'
    rows of ffn_up's halves, cut from the file's bytes."""
    group = OneDeviceGroup(open_or_skip("vulkan"))
    model = device_model(tmp_path, key)
    one = model.runner(group.devices[0], num_blocks=32)
    two = GroupRunner(model, group, kind, 32)
    two.allocate()
    two.upload()
    same_greedy(one, two, 12)


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
@pytest.mark.parametrize("key", GROUP_MODELS)
def test_group_over_two_cuda_devices_equals_one(tmp_path, kind, key):
    try:
        group = PtxGroup([0, 1])
    except (BackendUnavailable, NoSuchDevice) as e:
        pytest.skip(f"two CUDA devices are needed: {e}")
    model = device_model(tmp_path, key)
    one = model.runner(group.devices[0], num_blocks=32)
    two = GroupRunner(model, group, kind, 32)
    two.allocate()
    two.upload()
    same_greedy(one, two, 24)
