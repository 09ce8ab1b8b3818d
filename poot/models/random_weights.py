"""Llama-, Phi-3- and Gemma-shaped GGUF files with random weights, for tests and benchmarks on
machines with no network: tiny ones for fast end-to-end tests, Llama-3.2-1B, Llama-3.1-8B and
Qwen3-30B-A3B (a mixture of experts) shapes for speed.

A Llama's tokenizer is a real byte-level BPE (every byte a token, plus merges learnt from a
short text) with ChatML special tokens and template; a Gemma's a real SentencePiece BPE with
Gemma's conventions (byte fallback, no space prefix, <start_of_turn>/<end_of_turn> and its turn
template). Generated files run everywhere a real model runs. Weights are drawn so activations
stay of order one through the layers.
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
    "tiny-deep": Shape(4, 64, 4, 2, 128, 320, context_length=512),  # SmolLM3's 4th: no rope
    "tiny-wide": Shape(2, 64, 4, 2, 128, 49152, context_length=512),  # the default model's vocab
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


def learnt_merges(words, n_merges):
    """BPE's merges learnt from `words` (each a list of symbols, merged in place): the most
    frequent adjacent pair, up to n_merges times."""
    for _ in range(n_merges):
        pairs = Counter(p for w in words for p in zip(w, w[1:]))
        if not pairs:
            return
        (a, b), _ = pairs.most_common(1)[0]
        yield a, b
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i:i + 2] = [a + b]
                i += 1


def byte_level_vocab(vocab_size, n_merges=40, specials=SPECIALS):
    """Tokens (specials, 256 bytes, merged pairs, reserved fillers) and the merge list."""
    symbols = byte_symbols()
    words = [[symbols[b] for b in (" " + w if i else w).encode()] for i, w in
             enumerate(CORPUS.split(" ")) if w]
    tokens, merges = list(specials) + [symbols[b] for b in range(256)], []
    for a, b in learnt_merges(words, n_merges):
        merges.append(f"{a} {b}")
        tokens.append(a + b)
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
    meta = {
        "general.architecture": arch, "general.name": f"random-{arch}",
        f"{arch}.block_count": s.n_layers, f"{arch}.context_length": s.context_length,
        f"{arch}.embedding_length": s.d_model, f"{arch}.feed_forward_length": s.d_ff,
        f"{arch}.attention.head_count": s.n_heads,
        f"{arch}.attention.head_count_kv": s.n_kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": s.rope_theta, f"{arch}.vocab_size": s.vocab_size,
        **byte_level_metadata(s.vocab_size, SPECIALS, CHATML, eos=2),
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


def byte_level_metadata(vocab_size, specials, chat_template, eos):
    """A GGUF file's tokenizer keys: byte_level_vocab's tokens (`specials` as control tokens,
    the first of them BOS, token `eos` EOS), no BOS added, and the chat template."""
    tokens, merges = byte_level_vocab(vocab_size, specials=specials)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": eos, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": chat_template}


# Phi-3's chat format: a turn is <|role|>, a newline, the text, <|end|> and a newline
PHI3_CHAT = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + "
             "message['content'] + '<|end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}"
             "{% endif %}")
PHI3_SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def write_random_phi3(path, shape="tiny", dtype="F16", seed=0, longrope=False, rope_dim=None,
                      tied=False, window=0):
    """Writes a random-weight Phi-3 of `shape` to `path` as llama.cpp's converter lays one out:
    q, k and v in one tensor (attn_qkv), gate and up in one (ffn_up, gate first), matrices in
    `dtype`, norms in F32; its EOS is <|endoftext|> and its chat turns end with <|end|>.
    `longrope`: LongRoPE factor tensors (rope_factors_short/_long) for an original context of
    an eighth of the context, and their attention factor; `rope_dim`: rotated dims of a head
    (partial rotary, as Phi-4-mini); `tied`: no output.weight; `window`: a sliding window."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    head_dim = s.d_model // s.n_heads
    rope_dim = rope_dim or head_dim
    meta = {
        "general.architecture": "phi3", "general.name": "random-phi3",
        "phi3.block_count": s.n_layers, "phi3.context_length": s.context_length,
        "phi3.embedding_length": s.d_model, "phi3.feed_forward_length": s.d_ff,
        "phi3.attention.head_count": s.n_heads, "phi3.attention.head_count_kv": s.n_kv_heads,
        "phi3.attention.layer_norm_rms_epsilon": 1e-5, "phi3.rope.freq_base": s.rope_theta,
        "phi3.rope.dimension_count": rope_dim, "phi3.attention.sliding_window": window,
        "phi3.rope.scaling.original_context_length": s.context_length // (8 if longrope else 1),
        **byte_level_metadata(s.vocab_size, PHI3_SPECIALS, PHI3_CHAT, eos=0),
    }
    specs = [("token_embd.weight", dtype, RandomArray((s.vocab_size, s.d_model), 4.0))]
    if longrope:
        meta["phi3.rope.scaling.attn_factor"] = 1.2
        specs += [("rope_factors_long.weight", "F32", RandomArray((rope_dim // 2,), 2.0, 8.0)),
                  ("rope_factors_short.weight", "F32", RandomArray((rope_dim // 2,), 0.2, 1.2))]
    qkv = (s.n_heads + 2 * s.n_kv_heads) * head_dim
    for i in range(s.n_layers):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", "F32", RandomArray((s.d_model,), 0.1, 1.0)),
                  (p + "attn_qkv.weight", dtype, RandomArray((qkv, s.d_model))),
                  (p + "attn_output.weight", dtype, RandomArray((s.d_model, s.d_model))),
                  (p + "ffn_norm.weight", "F32", RandomArray((s.d_model,), 0.1, 1.0)),
                  (p + "ffn_up.weight", dtype, RandomArray((2 * s.d_ff, s.d_model))),
                  (p + "ffn_down.weight", dtype, RandomArray((s.d_model, s.d_ff)))]
    specs.append(("output_norm.weight", "F32", RandomArray((s.d_model,), 0.1, 1.0)))
    if not tied:
        specs.append(("output.weight", dtype, RandomArray((s.vocab_size, s.d_model))))
    for index, (_, _, values) in enumerate(specs):
        values.seed = (seed, index)
    write_gguf(path, meta, specs)
    return path


GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + "
                  "('model' if message['role'] == 'assistant' else message['role']) + '\\n' + "
                  "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                  "<end_of_turn>"]


def sentencepiece_vocab(vocab_size, n_merges=40):
    """Gemma-style SentencePiece BPE pieces: specials, the 256 byte-fallback tokens <0xXX>,
    the corpus's characters (spaces spelled '▁', no space prefixed), then merged pairs;
    (tokens, scores, GGUF token types). A merge's score is minus its rank: higher merges
    first."""
    words = [list(w) for w in CORPUS.replace(" ", "▁").split("▁")]
    words = [(["▁"] if i else []) + w for i, w in enumerate(words) if w]
    tokens = GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2, 3, 3, 3] + [6] * 256
    chars = sorted({c for w in words for c in w})
    tokens += chars
    types += [1] * len(chars)
    scores = [0.0] * (len(tokens) - len(chars)) + [-1e6] * len(chars)
    for rank, (a, b) in enumerate(learnt_merges(words, n_merges)):
        tokens.append(a + b)
        types.append(1)
        scores.append(-float(rank))
    n = vocab_size - len(tokens)
    if n < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the SentencePiece base")
    return (tokens + [f"<unused{i}>" for i in range(n)], scores + [0.0] * n, types + [5] * n)


GEMMA_SHAPES = {"gemma2": dict(n_layers=3, attn_softcap=5.0, final_softcap=10.0),
                "gemma3": dict(n_layers=6, rope_scaling=4.0)}   # five sliding, one global


def write_random_gemma(path, arch="gemma2", dtype="F16", seed=0, d_model=64, n_heads=4,
                       n_kv_heads=2, head_dim=32, d_ff=128, vocab_size=400, window=8,
                       context=512):
    """Writes a tiny random Gemma 2 or 3 (`arch`) as llama.cpp's converter writes one: norms
    as 1 + w (drawn around 1), the embedding table as the output head, Gemma 2's soft-caps,
    Gemma 3's q/k norms and global layers' rope scaling; a sliding `window` short enough for
    tests to cross; a `context` of that many tokens. Matrices in `dtype`, norms in F32."""
    shape = GEMMA_SHAPES[arch]
    n_layers = shape["n_layers"]
    tokens, scores, types = sentencepiece_vocab(vocab_size)
    meta = {
        "general.architecture": arch, "general.name": f"random-{arch}",
        f"{arch}.block_count": n_layers, f"{arch}.context_length": context,
        f"{arch}.embedding_length": d_model, f"{arch}.feed_forward_length": d_ff,
        f"{arch}.attention.head_count": n_heads, f"{arch}.attention.head_count_kv": n_kv_heads,
        f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.attention.sliding_window": window,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": GEMMA_TEMPLATE,
    }
    if arch == "gemma2":
        meta[f"{arch}.attn_logit_softcapping"] = shape["attn_softcap"]
        meta[f"{arch}.final_logit_softcapping"] = shape["final_softcap"]
    else:
        meta[f"{arch}.rope.freq_base"] = 1000000.0
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = shape["rope_scaling"]

    def norm(name, n):
        return (name, "F32", RandomArray((n,), 0.1, 1.0))

    # the embedding, times sqrt(d_model) in the graph, of unit scale there
    specs = [("token_embd.weight", dtype, RandomArray((vocab_size, d_model), 1.0))]
    for i in range(n_layers):
        p = f"blk.{i}."
        specs += [norm(p + "attn_norm.weight", d_model),
                  (p + "attn_q.weight", dtype, RandomArray((n_heads * head_dim, d_model))),
                  (p + "attn_k.weight", dtype, RandomArray((n_kv_heads * head_dim, d_model))),
                  (p + "attn_v.weight", dtype, RandomArray((n_kv_heads * head_dim, d_model))),
                  (p + "attn_output.weight", dtype, RandomArray((d_model, n_heads * head_dim))),
                  norm(p + "post_attention_norm.weight", d_model),
                  norm(p + "ffn_norm.weight", d_model),
                  (p + "ffn_gate.weight", dtype, RandomArray((d_ff, d_model))),
                  (p + "ffn_up.weight", dtype, RandomArray((d_ff, d_model))),
                  (p + "ffn_down.weight", dtype, RandomArray((d_model, d_ff))),
                  norm(p + "post_ffw_norm.weight", d_model)]
        if arch == "gemma3":
            specs += [norm(p + "attn_q_norm.weight", head_dim),
                      norm(p + "attn_k_norm.weight", head_dim)]
    specs.append(norm("output_norm.weight", d_model))
    for index, (_, _, values) in enumerate(specs):
        values.seed = (seed, index)
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
