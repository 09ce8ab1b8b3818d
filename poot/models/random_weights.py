"""Llama-shaped GGUF files with random weights, for tests and benchmarks on machines with no
network: tiny ones for fast end-to-end tests, Llama-3.2-1B, Llama-3.1-8B and Qwen3-30B-A3B (a
mixture of experts) shapes for speed.

The tokenizer is a real byte-level BPE (every byte a token, plus merges learnt from a short
text) with ChatML special tokens and template, so generated files run everywhere a real model
runs. Weights are drawn so activations stay of order one through the layers.
"""
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..formats.gguf import Encoded, write_gguf
from ..formats.quants import quantize

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ("The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
          "Hello, world! It is a truth universally acknowledged, that a single man in "
          "possession of a good fortune, must be in want of a wife. 0123456789 ")


@dataclass(frozen=True)
class Shape:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    context_length: int = 2048
    rope_theta: float = 10000.0
    head_dim: int = 0            # 0: d_model / n_heads
    n_experts: int = 0           # a mixture of experts: d_ff is each expert's width
    experts_used: int = 0


SHAPES = {
    "tiny": Shape(2, 64, 4, 2, 128, 320, context_length=512),
    "tiny-k": Shape(2, 256, 4, 2, 512, 320, context_length=512),    # rows fit 256-element K blocks
    "tiny-odd": Shape(3, 96, 6, 3, 192, 320, context_length=512),   # 3 KV heads: uneven shards
    "llama-1b": Shape(16, 2048, 32, 8, 8192, 128256, 131072, 500000.0),
    "llama-8b": Shape(32, 4096, 32, 8, 14336, 128256, 131072, 500000.0),
    "tiny-moe": Shape(2, 256, 4, 2, 256, 320, context_length=512, n_experts=6, experts_used=2),
    "qwen3-30b-a3b": Shape(48, 2048, 32, 4, 768, 151936, 40960, 1000000.0, head_dim=128,
                           n_experts=128, experts_used=8),
}


def byte_symbols():
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def byte_level_vocab(vocab_size, n_merges=40):
    """Tokens (specials, 256 bytes, merged pairs, reserved fillers) and the merge list."""
    symbols = byte_symbols()
    words = [[symbols[b] for b in (" " + w if i else w).encode()] for i, w in
             enumerate(CORPUS.split(" ")) if w]
    tokens, merges = SPECIALS + [symbols[b] for b in range(256)], []
    for _ in range(n_merges):
        pairs = Counter(p for w in words for p in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i:i + 2] = [a + b]
                i += 1
    tokens += [f"<|reserved_{i}|>" for i in range(vocab_size - len(tokens))]
    if len(tokens) != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the byte-level base")
    return tokens, merges


def write_random_llama(path, shape="tiny", dtype="F16", seed=0, arch="llama", mixed=(),
                       pool_rows=None, tied=False):
    """Writes a random-weight model of `shape` (a name in SHAPES or a Shape) to `path`.

    Matrices are stored in `dtype` (F32, F16, BF16 or a block quantisation); norms in F32.
    `mixed` gives some matrices another dtype, as quantisation mixes do (Q4_K_M keeps attn_v
    in Q6_K): (("attn_v", "Q6_K"), ...) by the name's part after the layer.
    `arch` "qwen2" adds q/k/v biases, "qwen3" q/k norms; a shape with experts makes a mixture
    of experts (arch "llama": Mixtral's layout, "qwen3moe": Qwen3-MoE's, with q/k norms), its
    router in F32 as llama.cpp's quantiser keeps it. `tied`: no output.weight, the
    embedding table serves as the output head (as in SmolLM2 and the small Qwens).
    `pool_rows` (for benchmarks): each matrix draws and encodes only that many random rows and
    fills its rows from them in random order, so an 8B-shaped file is written in the time its
    bytes take to reach the disk (a quantised one would otherwise take numpy many minutes);
    every byte is still read by the kernels as in any model.
    """
    def matrix(name):
        return dict(mixed).get(name.split(".")[-2], dtype)

    s = SHAPES[shape] if isinstance(shape, str) else shape
    head_dim = s.head_dim or s.d_model // s.n_heads
    tokens, merges = byte_level_vocab(s.vocab_size)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    meta = {
        "general.architecture": arch, "general.name": f"random-{arch}",
        f"{arch}.block_count": s.n_layers, f"{arch}.context_length": s.context_length,
        f"{arch}.embedding_length": s.d_model, f"{arch}.feed_forward_length": s.d_ff,
        f"{arch}.attention.head_count": s.n_heads,
        f"{arch}.attention.head_count_kv": s.n_kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": s.rope_theta, f"{arch}.vocab_size": s.vocab_size,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    if s.head_dim:
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = head_dim
    if s.n_experts:
        meta.update({f"{arch}.expert_count": s.n_experts,
                     f"{arch}.expert_used_count": s.experts_used})
    if arch == "qwen3moe":
        meta[f"{arch}.expert_feed_forward_length"] = s.d_ff

    specs = [("token_embd.weight", dtype, RandomArray((s.vocab_size, s.d_model), 4.0))]
    for i in range(s.n_layers):
        p = f"blk.{i}."
        specs.append((p + "attn_norm.weight", "F32", RandomArray((s.d_model,), 0.1, 1.0)))
        for name, rows in (("attn_q", s.n_heads * head_dim), ("attn_k", s.n_kv_heads * head_dim),
                           ("attn_v", s.n_kv_heads * head_dim)):
            specs.append((p + name + ".weight", matrix(p + name + ".weight"),
                          RandomArray((rows, s.d_model))))
            if arch == "qwen2":
                specs.append((p + name + ".bias", "F32", RandomArray((rows,), 0.1)))
        if arch in ("qwen3", "qwen3moe"):
            specs.append((p + "attn_q_norm.weight", "F32", RandomArray((head_dim,), 0.1, 1.0)))
            specs.append((p + "attn_k_norm.weight", "F32", RandomArray((head_dim,), 0.1, 1.0)))
        specs += [(p + "attn_output.weight", matrix(p + "attn_output.weight"),
                   RandomArray((s.d_model, s.n_heads * head_dim))),
                  (p + "ffn_norm.weight", "F32", RandomArray((s.d_model,), 0.1, 1.0))]
        if s.n_experts:
            X = s.n_experts
            specs += [(p + "ffn_gate_inp.weight", "F32", RandomArray((X, s.d_model), 2.0)),
                      (p + "ffn_gate_exps.weight", matrix(p + "ffn_gate_exps.weight"),
                       RandomArray((X, s.d_ff, s.d_model))),
                      (p + "ffn_up_exps.weight", matrix(p + "ffn_up_exps.weight"),
                       RandomArray((X, s.d_ff, s.d_model))),
                      (p + "ffn_down_exps.weight", matrix(p + "ffn_down_exps.weight"),
                       RandomArray((X, s.d_model, s.d_ff)))]
            continue
        specs += [(p + "ffn_gate.weight", matrix(p + "ffn_gate.weight"),
                   RandomArray((s.d_ff, s.d_model))),
                  (p + "ffn_up.weight", matrix(p + "ffn_up.weight"),
                   RandomArray((s.d_ff, s.d_model))),
                  (p + "ffn_down.weight", matrix(p + "ffn_down.weight"),
                   RandomArray((s.d_model, s.d_ff)))]
    specs.append(("output_norm.weight", "F32", RandomArray((s.d_model,), 0.1, 1.0)))
    if not tied:
        specs.append(("output.weight", dtype, RandomArray((s.vocab_size, s.d_model))))
    for index, (_, _, values) in enumerate(specs):
        values.seed = (seed, index)
    if pool_rows:
        specs = [(name, d, values.pooled(d, pool_rows) if len(values.shape) >= 2 else values)
                 for name, d, values in specs]
    write_gguf(path, meta, specs)
    return path


class RandomArray:
    """A tensor drawn only when written: normal values times `scale` (for matrices, divided by
    the square root of the row length, so products keep unit scale) plus `offset`."""

    def __init__(self, shape, scale=1.0, offset=0.0):
        self.shape, self.scale, self.offset, self.seed = shape, scale, offset, 0

    def pooled(self, dtype, rows):
        """The matrix (or stack of them) encoded in `dtype` with its rows drawn from `rows`
        random ones."""
        n_rows, cols = math.prod(self.shape[:-1]), self.shape[-1]
        if n_rows <= rows:
            return self
        pool = RandomArray((rows, cols), self.scale, self.offset)
        pool.seed = self.seed
        encoded = quantize(dtype, np.asarray(pool)).reshape(rows, -1)
        order = np.random.default_rng(self.seed).integers(0, rows, n_rows)
        return Encoded(self.shape, np.take(encoded, order, axis=0).reshape(-1))

    def __array__(self, dtype=None, copy=None):
        values = np.random.default_rng(self.seed).standard_normal(self.shape, dtype=np.float32)
        scale = self.scale / np.sqrt(self.shape[-1]) if len(self.shape) >= 2 else self.scale
        return (values * np.float32(scale) + np.float32(self.offset)).astype(dtype or np.float32)


SPEC_SHAPES = {"tiny": "tiny-k", "1b": "llama-1b", "8b": "llama-8b", "tiny-moe": "tiny-moe",
               "30b-a3b": "qwen3-30b-a3b"}
SHAPE_ARCHS = {"tiny-moe": "qwen3moe", "qwen3-30b-a3b": "qwen3moe"}   # the others: llama
POOL_ROWS = 512         # a benchmark matrix's rows drawn from this many random ones


def model_file(spec, folder):
    """The file of a model named as the scripts name them: 'default' (the default model), or
    SIZE:FORMAT (tiny, 1b, 8b, tiny-moe or 30b-a3b, e.g. 8b:F16; the last two mixtures of
    experts, Qwen3-MoE-shaped) for a random model of that shape, written into
    `folder` once (matrices pooled from POOL_ROWS rows: an 8B file is written in seconds)."""
    from ..loader import default_model_path
    if spec == "default":
        return default_model_path()
    size, _, dtype = spec.partition(":")
    if size not in SPEC_SHAPES or not dtype:
        raise ValueError(f"model {spec!r}: expected default or SIZE:FORMAT with SIZE one of "
                         f"{', '.join(SPEC_SHAPES)} (e.g. 1b:F16)")
    path = Path(folder) / f"random-{size}-{dtype.lower()}-pooled.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shape = SPEC_SHAPES[size]
        write_random_llama(path, shape, dtype=dtype, pool_rows=POOL_ROWS,
                           arch=SHAPE_ARCHS.get(shape, "llama"))
    return path
