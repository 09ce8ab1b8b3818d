"""The Llama family graph, interpreted by the reference, against Hugging Face transformers.

transformers (with torch on the CPU) is a test-only, independent implementation of the same
models: tiny random models of each variant are built there, saved as safetensors, loaded here,
and their logits compared over whole prompts, chunked prefill with decode, and paged caches
shared by several sequences. A GGUF copy (q/k permuted as llama.cpp's converter stores llama
weights) checks the GGUF rope layout the same way.
"""
import numpy as np
import pytest

from poot.engine.batch import SamplingRows, StepBatch
from poot.errors import ModelFileError
from poot.formats import open_model
from poot.formats.gguf import GGUFFile, write_gguf
from poot.ir.reference import ReferenceInterpreter
from poot.models import llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BLOCK = 4


def hf_model(tmp_path, arch, **extra):
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    common.update(extra)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
           "ernie4_5": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM),
           "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM)}[arch]
    model = cls[1](cls[0](**common)).eval()
    with torch.no_grad():                     # norms away from 1 and biases away from 0
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp_path / arch
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


class Harness:
    """Runs the reference interpreter on a graph over a paged cache with shuffled blocks."""

    def __init__(self, cfg, shapes, weight, num_blocks=64, freq_factors=None, family=llama):
        self.graph = family.forward(cfg, shapes, num_blocks, BLOCK, freq_factors)
        state = {n: np.full(t.shape, np.nan, np.float32) for n, t in self.graph.state.items()}
        self.interp = ReferenceInterpreter(self.graph, weight, state)
        self.free = list(np.random.default_rng().permutation(num_blocks))
        self.tables = {}

    def run(self, chunks):
        """chunks: [(seq, start_position, token_ids)] in one step -> logits of every token."""
        tokens, positions, rows = [], [], []
        for row, (seq, start, ids) in enumerate(chunks):
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK < start + len(ids):
                table.append(self.free.pop())
            tokens += ids
            positions += range(start, start + len(ids))
            rows += [row] * len(ids)
        width = max(len(self.tables[s]) for s, _, _ in chunks)
        tables = np.array([self.tables[s] + [0] * (width - len(self.tables[s]))
                           for s, _, _ in chunks], np.int32)
        n = len(tokens)
        batch = StepBatch(np.array(tokens, np.int32), np.array(positions, np.int32),
                          np.array(rows, np.int32), tables, np.arange(n, dtype=np.int32),
                          SamplingRows.greedy(n))
        return self.interp.run({"tokens": batch.tokens, "positions": batch.positions,
                                "seq_rows": batch.seq_rows, "block_tables": batch.block_tables,
                                "sample_tokens": batch.sample_tokens})["logits"]


def from_folder(folder, family=llama):
    """(config, weight shapes, weight reader) of a Hugging Face folder, by GGUF name."""
    f = open_model(folder)
    names = {family.gguf_name(n): n for n in f.tensors if family.gguf_name(n)}
    cfg = family.config_from_hf(folder, f.config)
    shapes = {g: (f.tensors[n].shape, f.tensors[n].dtype) for g, n in names.items()}
    return cfg, shapes, lambda g: f.array(names[g])


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


GRANITE = {"embedding_multiplier": 6.0, "residual_multiplier": 0.3,
           "attention_multiplier": 0.09, "logits_scaling": 4.0}
VARIANTS = [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
               "tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen3", {"head_dim": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                                "original_max_position_embeddings": 32, "mscale": 0.8,
                                "mscale_all_dim": 0.5, "truncate": False}}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {}),
    ("smollm3", {"num_hidden_layers": 4, "pad_token_id": None}),    # the last has no rope
    ("smollm3", {"no_rope_layers": [0, 1], "pad_token_id": None}),   # the first
    ("ernie4_5", {"head_dim": 16, "tie_word_embeddings": True}),     # interleaved pairs
    ("granite", GRANITE),
    ("qwen3", {"head_dim": 32}),
]


@pytest.mark.parametrize("arch,extra", VARIANTS)
def test_whole_prompt_matches_transformers(tmp_path, arch, extra):
    model, folder = hf_model(tmp_path, arch, **extra)
    cfg, shapes, weight = from_folder(folder)
    ids = np.random.default_rng().integers(0, 97, 40).tolist()
    ours = Harness(cfg, shapes, weight).run([(0, 0, ids)])
    assert rel_err(ours, hf_logits(model, ids)) < 1e-4


@pytest.mark.parametrize("arch,extra", VARIANTS[:2] + VARIANTS[-2:])
def test_chunked_prefill_decode_and_batching_match(tmp_path, arch, extra):
    """Two sequences share one paged cache: prefill in uneven chunks, then decode together."""
    model, folder = hf_model(tmp_path, arch, **extra)
    cfg, shapes, weight = from_folder(folder)
    rng = np.random.default_rng()
    a, b = rng.integers(0, 97, 23).tolist(), rng.integers(0, 97, 17).tolist()
    harness = Harness(cfg, shapes, weight)
    got = {0: [], 1: []}
    got[0].append(harness.run([(0, 0, a[:9])]))
    out = harness.run([(0, 9, a[9:20]), (1, 0, b[:6])])
    got[0].append(out[:11]), got[1].append(out[11:])
    out = harness.run([(1, 6, b[6:15]), (0, 20, a[20:21])])
    got[1].append(out[:9]), got[0].append(out[9:])
    for i in range(2):                                # decode one token each per step
        out = harness.run([(0, 21 + i, a[21 + i:22 + i]), (1, 15 + i, b[15 + i:16 + i])])
        got[0].append(out[:1]), got[1].append(out[1:])
    assert rel_err(np.concatenate(got[0]), hf_logits(model, a)) < 1e-4
    assert rel_err(np.concatenate(got[1]), hf_logits(model, b)) < 1e-4


def permute_for_gguf(w, n_heads):
    """How GGUF llama files store q/k rows: each head's two rope halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 24.0}


@pytest.mark.parametrize("arch,extra", [("llama", {}),
                                        ("smollm3", {"num_hidden_layers": 4, "pad_token_id": None}),
                                        ("llama", {"rope_scaling": YARN}),
                                        ("ernie4_5", {"head_dim": 16}), ("granite", GRANITE)])
def test_gguf_llama_layout_matches_transformers(tmp_path, arch, extra):
    """As llama.cpp's converter writes them: q/k rows permuted (not ERNIE 4.5's, whose pairs
    are neighbours already), SmolLM3's layers without rope known by the architecture (every
    fourth), YaRN's scaling in rope.scaling.* keys."""
    model, folder = hf_model(tmp_path, arch, **extra)
    f = open_model(folder)
    cfg = llama.config_from_hf(folder, f.config)
    tensors = []
    for name in f.tensors:
        g, w = llama.gguf_name(name), f.array(name)
        if g.endswith("attn_q.weight") and arch != "ernie4_5":
            w = permute_for_gguf(w, cfg.n_heads)
        elif g.endswith("attn_k.weight") and arch != "ernie4_5":
            w = permute_for_gguf(w, cfg.n_kv_heads)
        tensors.append((g, "F32", w))
    meta = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in {
        "block_count": cfg.n_layers, "context_length": 256, "embedding_length": cfg.d_model,
        "feed_forward_length": cfg.d_ff, "attention.head_count": cfg.n_heads,
        "attention.head_count_kv": cfg.n_kv_heads, "vocab_size": 97,
        "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0}.items()}}
    if arch == "granite":
        meta.update({"granite.embedding_scale": 6.0, "granite.residual_scale": 0.3,
                     "granite.attention.scale": 0.09, "granite.logit_scale": 4.0})
    if "rope_scaling" in extra:
        meta.update({f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": 4.0,
                     f"{arch}.rope.scaling.original_context_length": 64,
                     f"{arch}.rope.scaling.yarn_beta_fast": 24.0})
    write_gguf(tmp_path / "m.gguf", meta, tensors)
    gguf = GGUFFile(tmp_path / "m.gguf")
    gcfg = llama.config_from_gguf(gguf.path, gguf.metadata, gguf.tensors)
    assert gcfg.rope_style == "normal" and gcfg.n_kv_heads == 2
    assert gcfg.nope_layers == cfg.nope_layers == ({3} if arch == "smollm3" else set())
    shapes = {n: (t.shape, t.dtype) for n, t in gguf.tensors.items()}
    ids = np.random.default_rng().integers(0, 97, 30).tolist()
    ours = Harness(gcfg, shapes, gguf.array).run([(0, 0, ids)])
    assert rel_err(ours, hf_logits(model, ids)) < 1e-4


def test_yarn_keys_poot_does_not_read_are_refused(tmp_path):
    meta = {"general.architecture": "llama", "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 4.0, "llama.rope.scaling.original_context_length": 64,
            "llama.rope.scaling.yarn_log_multiplier": 0.1}
    with pytest.raises(ModelFileError, match="yarn_log_multiplier is not supported"):
        llama.config_from_gguf(tmp_path / "m.gguf", meta, {})


def test_llama3_scaling_keeps_short_and_slows_long_wavelengths():
    inv = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    scaled = llama.llama3_scaled(inv, 8.0, 1.0, 4.0, 8192)
    wavelen = 2 * np.pi / inv
    assert np.array_equal(scaled[wavelen < 8192 / 4], inv[wavelen < 8192 / 4])
    assert np.allclose(scaled[wavelen > 8192], inv[wavelen > 8192] / 8)
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert np.all((scaled[mid] <= inv[mid]) & (scaled[mid] >= inv[mid] / 8))
