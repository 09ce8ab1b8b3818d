"""The Phi-3 family in the graph IR: Phi-3-mini/medium (4k and 128k), Phi-3.5-mini, Phi-4 and
Phi-4-mini.

A Llama-shaped decoder (pre-norm RMSNorm, grouped-query attention, SwiGLU, neox rope) whose
variants are small named switches in `Phi3Config`: q, k and v come from one fused projection
(GGUF attn_qkv, Hugging Face qkv_proj) and gate and up from another (GGUF ffn_up of 2 d_ff rows,
gate first; Hugging Face gate_up_proj), each read as row slices of the file's one tensor;
LongRoPE frequency scaling with its attention factor (the 128k models); partial rotary and tied
embeddings (Phi-4-mini); a sliding window (Phi-3-mini-4k) that bounds the context served.
Weights are named as in GGUF files; Hugging Face names are mapped onto those.
"""
import math
from dataclasses import dataclass

import numpy as np

from ..engine.placement import Part
from ..errors import ModelFileError
from ..ir.graph import Graph
from . import llama
from .family import WrongShape, gguf_name_by, step_inputs, weight_reader
from .llama import rope_frequencies

GGUF_ARCHS = ("phi3",)
HF_ARCHS = {"Phi3ForCausalLM": "phi3"}
# Phi-3's chat turns end with <|end|>, while its files name <|endoftext|> as EOS (GGUF) or list
# <|end|> only in generation_config.json: the end of a turn ends generation
END_OF_TURN = ("<|end|>",)
LONGROPE = ("longrope", "su")       # "su": the name the first Phi-3 128k configs give it


@dataclass(frozen=True)
class Phi3Config:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int          # served: max_position_embeddings, within any sliding window
    norm_eps: float
    rope_theta: float
    rope_dim: int                # rotated dims of a head (Phi-4-mini rotates 3/4 of them)
    rope_style: str = "neox"
    rope_factors: tuple = ()     # LongRoPE's divisor of each pair's frequency, from config.json
    rope_factors_tensor: str = None   # GGUF: the file tensor that holds them (loader.py reads it)
    attn_factor: float = 1.0     # LongRoPE's scale of cos and sin
    tied_embeddings: bool = False

    def rope_inv_freq(self, freq_factors=None):
        """Rotation frequency of each dimension pair: the base ones divided by LongRoPE's
        factors, given as `freq_factors` (GGUF: read from rope_factors_tensor) or held by the
        config (Hugging Face)."""
        inv = rope_frequencies(self.rope_theta, self.rope_dim)
        factors = self.rope_factors if freq_factors is None else freq_factors
        if len(factors):
            inv = inv / np.asarray(factors, np.float64)
        return inv.astype(np.float32)


def longrope_choice(context, original):
    """Which of LongRoPE's two factor sets rotates a model served over `context` tokens:
    "long" when it exceeds the context the model was first trained on (`original`), else
    "short". llama.cpp chooses so, once, by its configured context; poot builds one graph for
    every serving shape, so it chooses by the model's context (context_length): a 128k model
    takes the long factors at every position. (transformers instead switches per forward call
    by the sequence's length, which agrees wherever a sequence passes `original`.)"""
    return "long" if context > original else "short"


def longrope_attn_factor(context, original):
    """LongRoPE's attention factor where a file gives none: sqrt(1 + ln(s) / ln(original)) for
    the scale s = context / original above 1, else 1 (the LongRoPE paper's rule, as
    transformers and llama.cpp's converter apply it)."""
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


def config_from_gguf(path, metadata, tensor_names):
    arch = metadata["general.architecture"]         # "phi3" (models.gguf_family)

    def key(name, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelFileError(path, f"metadata key {arch}.{name} is missing")
        return value

    d_model, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", d_model // n_heads))
    trained = int(key("context_length"))
    window = int(key("attention.sliding_window", 0))      # 0: none (Phi-4)
    context = min(trained, window) if window else trained  # beyond the window attention differs
    factors, attn_factor = None, 1.0
    if "rope_factors_long.weight" in tensor_names:
        original = int(key("rope.scaling.original_context_length", trained))
        factors = f"rope_factors_{longrope_choice(context, original)}.weight"
        if factors not in tensor_names:
            raise ModelFileError(path, f"tensor {factors} is missing", tensor=factors)
        attn_factor = float(key("rope.scaling.attn_factor",
                                longrope_attn_factor(trained, original)))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    return Phi3Config(
        arch=arch, n_layers=int(key("block_count")), d_model=d_model, n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=head_dim,
        d_ff=int(key("feed_forward_length")), vocab_size=int(vocab), context_length=context,
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)),
        rope_factors_tensor=factors, attn_factor=attn_factor,
        tied_embeddings="output.weight" not in tensor_names)


def config_from_hf(path, config):
    try:
        d_model, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or d_model // n_heads)
        trained = int(config["max_position_embeddings"])
        window = config.get("sliding_window")
        context = min(trained, int(window)) if window else trained
        # transformers 5 writes rope_parameters (theta inside); earlier ones rope_scaling
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
        partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        rope_dim = int(head_dim * partial)
        kind = rope.get("rope_type", rope.get("type", "default"))
        factors, attn_factor = (), 1.0
        if kind in LONGROPE:
            original = int(rope.get("original_max_position_embeddings")
                           or config.get("original_max_position_embeddings") or trained)
            factors = tuple(float(f) for f in rope[f"{longrope_choice(context, original)}_factor"])
            if len(factors) != rope_dim // 2:
                raise ModelFileError(path, f"rope scaling has {len(factors)} factors for "
                                           f"{rope_dim // 2} rotated pairs")
            attn_factor = rope.get("attention_factor")
            if attn_factor is None:
                scaled = rope.get("factor")
                attn_factor = (longrope_attn_factor(trained, original) if scaled is None
                               else longrope_attn_factor(float(scaled) * original, original))
        elif kind not in ("default", "none", None):
            raise ModelFileError(path, f"rope scaling {kind!r} is not supported")
        return Phi3Config(
            arch="phi3", n_layers=int(config["num_hidden_layers"]), d_model=d_model,
            n_heads=n_heads, n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=head_dim, d_ff=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]), context_length=context,
            norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=float(theta),
            rope_dim=rope_dim, rope_factors=factors, attn_factor=float(attn_factor),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as missing:
        raise ModelFileError(path, f"config.json lacks {missing}") from None


# Hugging Face tensor names -> the GGUF names of the file's tensors.
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name):
    """The GGUF name of a Hugging Face tensor name, or None for tensors the model does not use."""
    return gguf_name_by(hf_name, HF_LAYER_NAMES)


def forward(cfg, weights, num_blocks, block_size, freq_factors=None, part=None):
    """The decoder step as a graph. `weights` maps GGUF tensor names to (shape, dtype);
    `freq_factors` are LongRoPE's factors where the file holds them as a tensor (GGUF).

    The fused tensors are read as the graph's own weights, each a row slice of the file's
    tensor: attn_q, attn_k and attn_v of attn_qkv (files with separate q/k/v tensors are read
    as they are), ffn_gate and ffn_up of ffn_up's two halves. `part` (engine/placement.py)
    is one device's share of a group, as in models/llama.py: its layers, its KV heads (so its
    rows of q, of k and of v) and feed-forward columns (its rows of gate and of up), whether
    it embeds and computes the head."""
    g = Graph()
    tokens, positions, seq_rows, block_tables, sample_tokens = step_inputs(g)
    if freq_factors is not None and np.shape(freq_factors) != (cfg.rope_dim // 2,):
        raise WrongShape(cfg.rope_factors_tensor, (cfg.rope_dim // 2,), np.shape(freq_factors))
    inv_freq = g.const("rope_inv_freq", cfg.rope_inv_freq(freq_factors))
    w = weight_reader(g, weights)

    def rows_of(name, tensor, n_rows, start, stop):
        """Weight `name`: rows start..stop of the file's [n_rows, d_model] `tensor` (unsliced
        when they are all of it)."""
        rows = None if (start, stop) == (0, n_rows) else (start, stop)
        return w(name, n_rows, E, rows=rows, tensor=tensor)

    def reduced(partial):
        return g.all_reduce(partial, part.world) if part.world > 1 else partial

    part = part or Part((0, cfg.n_layers))
    H, Hkv, D, E, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff
    group = H // Hkv
    kv0, kv1 = part.kv_heads or (0, Hkv)
    f0, f1 = part.ff or (0, F)
    Hs, Hkvs = (kv1 - kv0) * group, kv1 - kv0
    q_part, kv_part = (kv0 * group * D, kv1 * group * D), (kv0 * D, kv1 * D)
    whole = (kv0, kv1, f0, f1) == (0, Hkv, 0, F)
    if part.first:
        x = g.embedding(w("token_embd.weight", cfg.vocab_size, E), tokens)
    else:
        x = g.input("hidden", ("T", E), "f32")
    for i in range(*part.layers):
        p = f"blk.{i}."
        # attention block: q, k, v from one fused tensor, or from three
        if p + "attn_qkv.weight" in weights:
            fused, n = p + "attn_qkv.weight", (H + 2 * Hkv) * D
            where = {"attn_q": (fused, n, 0), "attn_k": (fused, n, H * D),
                     "attn_v": (fused, n, (H + Hkv) * D)}
        else:
            where = {"attn_q": (p + "attn_q.weight", H * D, 0),
                     "attn_k": (p + "attn_k.weight", Hkv * D, 0),
                     "attn_v": (p + "attn_v.weight", Hkv * D, 0)}
        rows = {"attn_q": q_part, "attn_k": kv_part, "attn_v": kv_part}
        h = g.rms_norm(x, w(p + "attn_norm.weight", E), cfg.norm_eps)
        q, k, v = (g.matmul(h, rows_of(p + name + ".weight", tensor, n, start + rows[name][0],
                                       start + rows[name][1]))
                   for name, (tensor, n, start) in where.items())
        q = g.rope(g.reshape(q, ("T", Hs, D)), positions, inv_freq, cfg.rope_style,
                   cfg.attn_factor)
        k = g.rope(g.reshape(k, ("T", Hkvs, D)), positions, inv_freq, cfg.rope_style,
                   cfg.attn_factor)
        v = g.reshape(v, ("T", Hkvs, D))
        k_cache = g.state_tensor(p + "k_cache", (num_blocks, block_size, Hkvs, D))
        v_cache = g.state_tensor(p + "v_cache", (num_blocks, block_size, Hkvs, D))
        g.store_kv(k, v, k_cache, v_cache, positions, seq_rows, block_tables)
        a = g.attention(q, k_cache, v_cache, positions, seq_rows, block_tables, D ** -0.5)
        o = g.matmul(g.reshape(a, ("T", Hs * D)),
                     w(p + "attn_output.weight", E, H * D, cols=None if whole else q_part))
        x = g.add(x, reduced(o))
        # feed-forward block: gate and up are the two halves of ffn_up
        h = g.rms_norm(x, w(p + "ffn_norm.weight", E), cfg.norm_eps)
        gate = g.matmul(h, rows_of(p + "ffn_gate.weight", p + "ffn_up.weight", 2 * F, f0, f1))
        up = g.matmul(h, rows_of(p + "ffn_up.weight", p + "ffn_up.weight", 2 * F, F + f0,
                                 F + f1))
        x = g.add(x, reduced(g.matmul(g.glu(gate, up, "silu"),
                                      w(p + "ffn_down.weight", E, F,
                                        cols=None if whole else (f0, f1)))))
    if not part.last:
        g.output("hidden", x)
        return g
    # only the sampled rows need the final norm and the (large) output projection
    last = g.gather(x, sample_tokens)
    if part.logits:
        g.output("last_hidden", last)       # what embeddings pool (llama.embedding)
    x = g.rms_norm(last, w("output_norm.weight", E), cfg.norm_eps)
    output = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    logits = g.matmul(x, w(output, cfg.vocab_size, E, rows=part.vocab))
    if part.vocab is not None:
        logits = g.all_gather(logits, part.world, cfg.vocab_size)
    if part.logits:
        g.output("logits", logits)
    return g


embedding = llama.embedding     # a prompt's embedding: the output norm's scale, unit length
