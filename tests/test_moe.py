"""Mixtures of experts (Mixtral, Qwen3-MoE), interpreted by the reference, against Hugging Face
transformers.

Tiny random models of each are built with transformers, saved as safetensors (one tensor per
expert, which the loader stacks) and copied into GGUF files (the experts stacked as llama.cpp's
converter writes them); both give transformers' logits, and both formats' configs agree.
"""
import numpy as np
import pytest

import poot
from poot.errors import ModelFileError
from poot.formats import open_model
from poot.formats.gguf import GGUFFile, write_gguf
from poot.ir import reference
from poot.kernels.lang import MMA_CAPS
from poot.loader import hf_weight_names
from poot.models import llama
from tests import lockstep
from tests.models import tiny_model
from tests.test_device_runner import greedy, prefill_of
from tests.test_llama import Harness, hf_logits, permute_for_gguf, rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97


def hf_moe(tmp_path, kind, **extra):
    """A random transformers model of `kind` (mixtral or qwen3moe), saved to a folder."""
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, num_experts_per_tok=2)
    if kind == "mixtral":
        common.update(intermediate_size=96, num_local_experts=4)
        config, cls = transformers.MixtralConfig, transformers.MixtralForCausalLM
    else:
        common.update(intermediate_size=128, moe_intermediate_size=32, num_experts=6,
                      head_dim=32)
        config, cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    common.update(extra)
    model = cls(config(**common)).eval()
    with torch.no_grad():                     # norms away from 1, routers decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    folder = tmp_path / kind
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def from_folder(folder):
    f = open_model(folder)
    names = hf_weight_names(folder, llama, f.tensors)
    cfg = llama.config_from_hf(folder, f.config)

    def weight(name):
        parts = names[name]
        return np.stack([f.array(n) for n in parts]) if isinstance(parts, tuple) else f.array(parts)
    shapes = {g: (weight(g).shape, "F32") for g in names}
    return cfg, shapes, weight


def to_gguf(path, folder, cfg):
    """The folder's model as a GGUF file: llama's q/k rows permuted, experts stacked."""
    _, _, weight = from_folder(folder)
    names = hf_weight_names(folder, llama, open_model(folder).tensors)
    tensors = []
    for g in names:
        w = weight(g)
        if cfg.arch == "llama" and g.endswith("attn_q.weight"):
            w = permute_for_gguf(w, cfg.n_heads)
        elif cfg.arch == "llama" and g.endswith("attn_k.weight"):
            w = permute_for_gguf(w, cfg.n_kv_heads)
        tensors.append((g, "F32", w))
    a = cfg.arch
    meta = {"general.architecture": a, f"{a}.block_count": cfg.n_layers,
            f"{a}.context_length": 256, f"{a}.embedding_length": cfg.d_model,
            f"{a}.attention.head_count": cfg.n_heads, f"{a}.vocab_size": VOCAB,
            f"{a}.attention.head_count_kv": cfg.n_kv_heads,
            f"{a}.attention.key_length": cfg.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": cfg.norm_eps,
            f"{a}.rope.freq_base": cfg.rope_theta, f"{a}.expert_count": cfg.n_experts,
            f"{a}.expert_used_count": cfg.experts_used}
    if a == "qwen3moe":     # the dense width too, which a model of experts only does not use
        meta.update({f"{a}.feed_forward_length": 4 * cfg.d_ff,
                     f"{a}.expert_feed_forward_length": cfg.d_ff,
                     f"{a}.expert_weights_norm": cfg.norm_topk})
    else:
        meta[f"{a}.feed_forward_length"] = cfg.d_ff
    write_gguf(path, meta, tensors)
    return GGUFFile(path)


VARIANTS = [("mixtral", {}), ("qwen3moe", {"norm_topk_prob": True}),
            ("qwen3moe", {"norm_topk_prob": False})]


@pytest.mark.parametrize("kind,extra", VARIANTS)
def test_safetensors_and_gguf_match_transformers(tmp_path, kind, extra):
    model, folder = hf_moe(tmp_path, kind, **extra)
    cfg, shapes, weight = from_folder(folder)
    assert (cfg.n_experts, cfg.experts_used) == ((4, 2) if kind == "mixtral" else (6, 2))
    assert cfg.norm_topk == extra.get("norm_topk_prob", True)
    ids = np.random.default_rng().integers(0, VOCAB, 40).tolist()
    theirs = hf_logits(model, ids)
    assert rel_err(Harness(cfg, shapes, weight).run([(0, 0, ids)]), theirs) < 1e-4

    gguf = to_gguf(tmp_path / "m.gguf", folder, cfg)
    gcfg = llama.config_from_gguf(gguf.path, gguf.metadata, gguf.tensors)
    assert gcfg == cfg.__class__(**{**cfg.__dict__, "context_length": 256,
                                    "norm_eps": float(np.float32(cfg.norm_eps)),
                                    "rope_style": "normal" if kind == "mixtral" else "neox"})
    gshapes = {n: (t.shape, t.dtype) for n, t in gguf.tensors.items()}
    assert gshapes["blk.1.ffn_down_exps.weight"][0] == (cfg.n_experts, cfg.d_model, cfg.d_ff)
    harness = Harness(gcfg, gshapes, gguf.array)
    got = [harness.run([(0, 0, ids[:25])]), harness.run([(0, 25, ids[25:])])]
    assert rel_err(np.concatenate(got), theirs) < 1e-4


def test_route_and_expert_ops_mean_what_they_say():
    """The routing ops against a direct, per-token reading of their definitions."""
    rng = np.random.default_rng()
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    logits[0, 2] = logits[0, 6] = 5.0                  # a tie goes to the lower index
    ids = reference.top_k(logits, 3)
    for t in range(5):
        assert logits[t, ids[t]].tolist() == sorted(logits[t], reverse=True)[:3]
    assert ids[0, :2].tolist() == [2, 6]
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    for normalize in (False, True):
        w = reference.route_weights(logits, ids, normalize)
        chosen = np.take_along_axis(probs, ids, -1)
        assert np.allclose(w, chosen / chosen.sum(-1, keepdims=True) if normalize else chosen)
    experts = rng.standard_normal((8, 6, 4)).astype(np.float32)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = reference.expert_matmul(x, experts, ids)
    for t in range(5):
        for j in range(3):
            assert np.allclose(y[t, j], experts[ids[t, j]] @ x[t], atol=1e-5)
    y2 = reference.expert_matmul(rng.standard_normal((5, 3, 6)).astype(np.float32),
                                 experts.transpose(0, 2, 1).copy(), ids)
    assert y2.shape == (5, 3, 4)
    summed = reference.expert_sum(y, w)
    assert np.allclose(summed[2], (w[2][:, None] * y[2]).sum(0), atol=1e-5)


def test_experts_stored_one_tensor_each_are_refused(tmp_path):
    """An older Mixtral conversion (blk.N.ffn_gate.E.weight) is refused by name."""
    meta = {"general.architecture": "llama", "llama.block_count": 1, "llama.context_length": 64,
            "llama.embedding_length": 32, "llama.feed_forward_length": 64,
            "llama.attention.head_count": 4, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.expert_count": 2, "llama.expert_used_count": 1, "llama.vocab_size": 8}
    names = ["blk.0.ffn_gate.0.weight", "blk.0.ffn_gate.1.weight"]
    with pytest.raises(ModelFileError, match="one tensor each"):
        llama.config_from_gguf(tmp_path / "old.gguf", meta, names)


def test_an_incomplete_set_of_experts_is_refused(tmp_path):
    _, folder = hf_moe(tmp_path, "qwen3moe")
    tensors = dict(open_model(folder).tensors)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ModelFileError, match="ffn_up_exps.weight lacks its part 3"):
        hf_weight_names(folder, llama, tensors)


def clear_routing(monkeypatch, attempts=20):
    """A function running its argument (a reference run of random inputs) until the routing
    has no near tie: every top_k's k-th largest router logit at least MARGIN above the next.
    Closer than that, the device's rounding (its f16 KV cache) may choose the other expert,
    a different and equally right model output, which no logit bound can take."""
    margins = []

    def recorded(x, k):
        ordered = -np.sort(-x, axis=-1)
        margins.append(float((ordered[:, k - 1] - ordered[:, k]).min()))
        return top_k(x, k)
    top_k = reference.KERNELS["top_k"]
    monkeypatch.setitem(reference.KERNELS, "top_k", recorded)

    def run(draw):
        for _ in range(attempts):
            margins.clear()
            result = draw()
            if min(margins) >= MARGIN:
                return result
        pytest.fail(f"no draw of {attempts} routes its tokens clear of ties")
    return run


MARGIN = 5e-3


@pytest.mark.parametrize("arch,dtype", [("llama", "F16"), ("qwen3moe", "Q4_0"),
                                        ("qwen3moe", "Q8_0"), ("llama", "Q4_K")])
def test_tiny_moe_on_a_device_matches_the_reference(tmp_path, device, arch, dtype, monkeypatch):
    """A random Mixtral- or Qwen3-MoE-shaped file through the device runner: greedy decoding
    gives the reference runner's tokens, and a 30-token prefill (routes grouped by expert,
    several a subgroup) its logits; on prompts whose routing is clear of ties."""
    model = poot.load(tiny_model(tmp_path, dtype=dtype, arch=arch, shape="tiny-moe"))
    assert model.config.n_experts == 6 and model.config.experts_used == 2
    rng = np.random.default_rng()
    clear = clear_routing(monkeypatch)
    table = list(rng.permutation(32))

    def decode():
        prompt = rng.integers(3, 300, 4).tolist()
        return prompt, greedy(model.runner(None, num_blocks=32), prompt, 8, table)
    prompt, (want_ids, want) = clear(decode)
    runner = model.runner(device, num_blocks=32, max_tokens=64)
    got_ids, got = greedy(runner, prompt, 8, table)
    assert got_ids == want_ids
    assert rel_err(got, want) < 2e-3                  # f16 KV cache

    def prefill():
        batch = prefill_of(30)
        return batch, model.runner(None, num_blocks=32).logits(batch)
    batch, want = clear(prefill)
    assert rel_err(runner.logits(batch), want) < 2e-3


def test_the_ptx_runner_in_lockstep_gives_the_reference_tokens(tmp_path, monkeypatch):
    """The ptx runner's own launches of a tiny Qwen3-MoE (Q4_0), every workgroup run by numpy
    at 32 lanes (tests/lockstep.py's LockstepDevice): greedy tokens and logits of the
    reference, through the prompt step and decode steps whose attention does the rope and
    cache store and whose experts take their routes one a workgroup column, the first expert
    launch choosing them itself (no route launch; the router's matvec makes the experts'
    x16); the same logits, bit for bit, as launches that keep those apart."""
    from poot.codegen.ptx import PTX_CAPS
    from poot.engine import expert_steps
    from poot.engine.device_runner import DeviceRunner
    model = poot.load(tiny_model(tmp_path, dtype="Q4_0", arch="qwen3moe", shape="tiny-moe"))
    table, prompt = list(np.random.default_rng(0).permutation(32)), [5, 80, 9, 41]
    want_ids, want = greedy(model.runner(None, num_blocks=32), prompt, 3, table)
    runs = []
    for apart in (False, True):
        with monkeypatch.context() as patch:
            if apart:
                patch.setattr(DeviceRunner, "_folds_rope", lambda self, i, T, R: None)
                patch.setattr(expert_steps, "takes_routes", lambda T: False)
            device = lockstep.LockstepDevice(PTX_CAPS)
            runner = model.runner(device, num_blocks=32, max_tokens=64)
            runs.append((*greedy(runner, prompt, 3, table), set(device.launched)))
    (got_ids, got, launched), (_, apart_logits, apart_launched) = runs
    assert got_ids == want_ids
    assert rel_err(got, want) < 2e-3
    assert np.array_equal(got, apart_logits)
    assert {"attention_d64_s32_k16_rope_neox_norm", "matvec_f32_t1_u2_s32_r2_normed_q4_0_norm",
            "expert_mma_vec_q4_0_u2_k8_x16_swiglu_routes_choose2_v1_norm",
            "expert_mma_vec_q4_0_u1_k8_routes"} <= launched
    assert "norm_rope_store_kv_neox_s32" in apart_launched and not any(
        name.startswith("attention") and "_rope_" in name or "_routes" in name or
        "_normed_" in name for name in apart_launched)


def test_a_moe_layer_lowers_to_its_expert_steps(tmp_path):
    """The router's matmul, its choice and weights in one step (with the grouping), one expert
    matvec for gate and up with their SwiGLU, one for down, and the weighted sum with the
    residual; the feed-forward norm folded into the router's and the experts' gate/up."""
    from poot.engine.lowering import lower
    model = poot.load(tiny_model(tmp_path, dtype="Q4_0", arch="qwen3moe", shape="tiny-moe"))
    steps, _ = lower(model.step_graph(8, 16))
    kinds = [s.kind for s in steps if s.kind != "reshape"]
    layer = kinds[kinds.index("route") - 1:kinds.index("expert_sum") + 1]
    assert layer == ["matmul", "route", "expert_matmul", "expert_matmul", "expert_sum"]
    assert not any(s.kind == "rms_norm" and "ffn_norm" in s.inputs[1].name for s in steps)
    router = steps[[s.kind for s in steps].index("route") - 1]
    gate_up = next(s for s in steps if s.kind == "expert_matmul")
    assert router.norm.name == gate_up.norm.name == "blk.0.ffn_norm.weight"
    assert gate_up.glu == "silu" and gate_up.up.name == "blk.0.ffn_up_exps.weight"
    assert next(s for s in steps if s.kind == "expert_sum").attrs == {"residual": True}


@pytest.mark.parametrize("matrix", [True, False])
def test_the_ptx_runner_launches_every_expert_step_it_builds(tmp_path, matrix):
    """On the host, as the ptx runner plans and launches (test_device_runner.LaunchLog): every
    step length, each layer's expert launches in order, each a kernel the runner builds with
    its arguments, the expert matvec over every expert the step can choose; and the plan holds
    every expert's weights in their format's planes. With the matrix instructions the experts
    run mma_vec's expert variant (its norm a norm_x16 launch first, its token tiles by the
    routes an expert has on average), without them expert_matvec by token groups. A one-token
    step with them launches no route: the router's matvec (one workgroup more) makes the
    experts' x16, and the gate/up launch chooses each workgroup column's route itself."""
    from poot.engine.device_runner import DeviceRunner
    from poot.kernels.quant import reader
    from tests.test_device_runner import LaunchLog
    model = poot.load(tiny_model(tmp_path, dtype="Q4_0", arch="qwen3moe", shape="tiny-moe"))
    log = LaunchLog(matrix)
    runner = DeviceRunner(model, log, num_blocks=32, max_tokens=300, max_seqs=16)
    runner.programs = {k.name: k for k in runner._kernels()}
    runner.buffers = {a.name: a for a in runner.allocations()}
    cfg = model.config
    planes = {a.name: a.nbytes for a in runner.allocations()
              if a.name.startswith("blk.0.ffn_down_exps.weight:")}
    r = reader("Q4_0")
    assert planes == {f"blk.0.ffn_down_exps.weight:{p}":
                      cfg.n_experts * cfg.d_model * r.row_words(p, cfg.d_ff) * 4
                      for p in r.plane_names}
    assert ("expert_x16" in runner.buffers) == matrix
    for T in (1, 2, 7, 33, 300):
        log.launched.clear()
        for _ in runner.launches(T, min(T, 16)):
            pass
        names = [kernel.name for kernel, _, _ in log.launched]
        assert all(runner.programs[kernel.name] is kernel for kernel, _, _ in log.launched)
        # up to GROUPED_ROUTES routes (decode steps), the choice and grouping are one launch
        routing = ["route_grouped2_s32_v1_norm"] if T * 2 <= 512 else ["route2_s32_v1_norm",
                                                                      "expert_groups"]
        if matrix and T <= 8:           # the route's workgroup makes the experts' x16 too
            routing = ["route_grouped2_s32_v1_norm_x16_f16_pairs"]
        if matrix and T == 1:           # the router makes it; gate/up chooses each route
            routing = ["matvec_f32_t1_u2_s32_r2_normed_q4_0_norm"]
            assert not any(name.startswith("route") for name in names)
        at = names.index(routing[0]) + len(routing)
        if matrix:
            tiles = "_n4" * (T * 2 > 3 * 8 * cfg.n_experts)     # mma_vec.token_tiles
            if T > 8:
                assert names[at] == "norm_x16_f16_pairs"
                at += 1
            by_route = "_routes" * (T == 1)
            chooses = "_choose2_v1_norm" * (T == 1)
            assert names[at].startswith("expert_mma_vec_q4_0_") and \
                names[at].endswith(f"_x16{tiles}_swiglu{by_route}{chooses}")
            assert names[at + 1].startswith("expert_mma_vec_q4_0_") and \
                names[at + 1].endswith(tiles + by_route) and "x16" not in names[at + 1]
            # the sum makes the x16 of the next layer's q/k/v matmul: mma_vec's words in a
            # short step, mma_tiled's in a long one; the last layer's sum is a plain one
            long = T >= runner.choice.mma_min_tokens
            fused = "expert_sum2_norm_x16_f16" + "_pairs" * (not long)
            assert names[at + 2] == fused and names[at + 3].startswith(("mma_vec", "mma_tiled"))
            assert names.count(fused) == cfg.n_layers - 1
            assert names.count("expert_sum2_residual") == 1
            matvecs = log.launched[at:at + 2]
        else:
            group = next(g for g in (1, 2, 4, 8) if g >= T) if T <= 8 else 8
            rows = "_r2" * (group == 1), "_r4" * (group == 1)   # matvec_rows
            assert names[at:at + 3] == [
                f"expert_matvec_q4_0_t{group}_s32{rows[0]}_norm_swiglu",
                f"expert_matvec_q4_0_t{group}_s32{rows[1]}", "expert_sum2_residual"]
            matvecs = log.launched[at:at + 2]
        assert names.count(routing[-1]) == cfg.n_layers
        if matrix and T == 1:           # the router's rows, and its workgroup for the x16
            given = [dict(zip([p.name for p in kernel.params], args))
                     for kernel, _, args in log.launched[at - 1:at + 3]]
            assert log.launched[at - 1][1] == (-(-cfg.n_experts // 16) + 1, 1)  # 16 rows a WG
            assert given[0]["x16"] is runner.buffers["expert_x16"] is given[1]["x16"]
            assert given[1]["logits"] is given[0]["y"]
            assert given[1]["ids"] is given[2]["ids"] and given[1]["w"] is given[3]["w"]
        for kernel, grid, args in matvecs:                  # the experts T can choose
            assert grid[1] == min(cfg.n_experts, T * cfg.experts_used)
            by_route = matrix and T == 1
            assert (runner.buffers["expert_active"] in args) != by_route


def test_a_hugging_face_moe_folder_on_a_device_matches_the_reference(tmp_path, device,
                                                                    monkeypatch):
    """A Qwen3-MoE safetensors folder (one tensor per expert, in BF16) loaded whole: the loader
    stacks each layer's experts for the reference and, in their device planes, for the
    device runner."""
    tokenizers = pytest.importorskip("tokenizers")
    from poot.models.random_weights import byte_level_vocab
    model, folder = hf_moe(tmp_path, "qwen3moe", vocab_size=320, norm_topk_prob=True,
                           dtype="bfloat16")
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    vocab, merges = byte_level_vocab(320)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(folder / "tokenizer.json"))
    loaded = poot.load(folder)
    assert loaded.weight_shapes()["blk.1.ffn_gate_exps.weight"] == ((6, 32, 64), "BF16")
    clear = clear_routing(monkeypatch)

    def prefill():
        batch = prefill_of(20)
        return batch, loaded.runner(None, num_blocks=32).logits(batch)
    batch, want = clear(prefill)
    got = loaded.runner(device, num_blocks=32, max_tokens=32).logits(batch)
    # BF16 weights: the tensor cores' paths (experts' mma_vec on ptx) read x rounded to bf16
    assert rel_err(got, want) < (8e-3 if MMA_CAPS["bf16"] in device.caps else 2e-3)


def test_tensor_placement_refuses_a_mixture_of_experts(tmp_path):
    """Its experts are not split by columns over a tensor group (a pipeline splits layers)."""
    from poot.engine.placement import tensor_parts
    from poot.errors import PlacementRefused
    model = poot.load(tiny_model(tmp_path, dtype="F16", arch="qwen3moe", shape="tiny-moe"))
    with pytest.raises(PlacementRefused, match="mixture of experts"):
        tensor_parts(model.config, model.weight_shapes(), 2)
