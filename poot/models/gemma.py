"""The Gemma 2 and Gemma 3 families in the graph IR (their text models).

`forward` reads top to bottom as the forward pass. What sets Gemma apart from Llama, each a
named part of `GemmaConfig`: embeddings scaled by sqrt(d_model); four RMS norms a layer (before
and after attention, before and after the feed-forward), each of gain 1 + w (GGUF files hold
1 + w, safetensors w: `hf_array`); a GeGLU feed-forward (tanh GELU); a query scale of its own
(`query_pre_attn_scalar`); sliding-window layers interleaved with global ones (Gemma 2 every
other layer, Gemma 3 five in six), each kind with its own rope base (and the global layers'
rope scaling); soft-capped attention scores and final logits (Gemma 2); q/k norms (Gemma 3);
the embedding table as the output head. Weights are named as in GGUF files.
"""
from dataclasses import dataclass

import numpy as np

from ..engine.placement import Part
from ..errors import ModelFileError
from ..ir.graph import Graph
from .family import gguf_name_by, step_inputs, weight_reader
from .llama import embedding  # noqa: F401  (the same rule: the last token's final hidden state)

GGUF_ARCHS = ("gemma2", "gemma3")
HF_ARCHS = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
END_OF_TURN = ("<end_of_turn>",)     # ends a turn of Gemma's chat format, and generation

# What each generation fixes where a file may say nothing (as llama.cpp reads GGUF files):
# which layers slide (layer i does where i % pattern < pattern - 1), the sliding layers' rope
# base, the window, and Gemma 2's caps.
DEFAULTS = {
    "gemma2": dict(pattern=2, local_theta=None, theta=10000.0, window=4096,
                   attn_softcap=50.0, final_softcap=30.0),
    "gemma3": dict(pattern=6, local_theta=10000.0, theta=1000000.0, window=4096,
                   attn_softcap=0.0, final_softcap=0.0),
}
# GGUF files carry no query_pre_attn_scalar: llama.cpp takes d_model / n_heads for the 27B
# models (Gemma 2: 46 layers, Gemma 3: 62) and head_dim for the others, as their configs say.
QUERY_SCALAR_BY_WIDTH = {"gemma2": 46, "gemma3": 62}


@dataclass(frozen=True)
class GemmaConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float            # global layers
    rope_local_theta: float      # sliding-window layers
    query_scalar: float          # scores are q . k / sqrt(query_scalar)
    sliding_window: int
    sliding: tuple               # per layer: whether it attends only within the window
    rope_scaling: tuple = ()     # the global layers': () | ("linear", factor)
    attn_softcap: float = 0.0    # 0: none
    final_softcap: float = 0.0
    qk_norm: bool = False        # Gemma 3
    tied_embeddings: bool = True

    @property
    def rope_style(self):
        return "neox"            # Gemma's q/k rows are stored unpermuted in GGUF files too

    def rope_inv_freq(self, local):
        """Rotation frequency of each dimension pair of a sliding (`local`) or global layer."""
        theta = self.rope_local_theta if local else self.rope_theta
        inv = 1.0 / theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        if not local and self.rope_scaling:
            inv = inv / self.rope_scaling[1]
        return inv.astype(np.float32)


def sliding_pattern(n_layers, pattern):
    return tuple(i % pattern < pattern - 1 for i in range(n_layers))


def config_from_gguf(path, metadata, tensor_names):
    arch = metadata["general.architecture"]         # one of GGUF_ARCHS (models.gguf_family)
    defaults = DEFAULTS[arch]
    if "rope_freqs.weight" in tensor_names:
        raise ModelFileError(path, "tensor rope_freqs.weight: Gemma takes no rope frequency "
                                   "factors")

    def key(name, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelFileError(path, f"metadata key {arch}.{name} is missing")
        return value

    n_layers, d_model = int(key("block_count")), int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", d_model // n_heads))
    pattern = key("attention.sliding_window_pattern", defaults["pattern"])
    if isinstance(pattern, (list, np.ndarray)):
        sliding = tuple(bool(s) for s in pattern)
        if len(sliding) != n_layers:
            raise ModelFileError(path, f"{arch}.attention.sliding_window_pattern has "
                                       f"{len(sliding)} layers, the model {n_layers}")
    else:
        sliding = sliding_pattern(n_layers, int(pattern))
    scaling = ()
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        scaling = ("linear", float(key("rope.scaling.factor")))
    elif kind not in ("none", None):
        raise ModelFileError(path, f"rope scaling {kind!r} is not supported")
    theta = float(key("rope.freq_base", defaults["theta"]))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ModelFileError(path, f"neither {arch}.vocab_size nor a token list gives the "
                                   "vocabulary's size")
    wide = n_layers == QUERY_SCALAR_BY_WIDTH[arch]
    return GemmaConfig(
        arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=head_dim,
        d_ff=int(key("feed_forward_length")), vocab_size=int(vocab),
        context_length=int(key("context_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_local_theta=float(key("rope.freq_base_swa", defaults["local_theta"] or theta)),
        query_scalar=float(d_model // n_heads if wide else head_dim),
        sliding_window=int(key("attention.sliding_window", defaults["window"])),
        sliding=sliding, rope_scaling=scaling,
        attn_softcap=float(key("attn_logit_softcapping", defaults["attn_softcap"])),
        final_softcap=float(key("final_logit_softcapping", defaults["final_softcap"])),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        tied_embeddings="output.weight" not in tensor_names)


def _hf_rope(path, config, arch):
    """(global theta, local theta, global scaling) from config.json: transformers 5 writes
    rope_parameters (per layer type for Gemma 3), earlier ones rope_theta, rope_scaling and
    Gemma 3's rope_local_base_freq."""
    params = config.get("rope_parameters") or {}
    full = params.get("full_attention", params)
    local = params.get("sliding_attention", {})
    theta = full.get("rope_theta") or config.get("rope_theta") or DEFAULTS[arch]["theta"]
    local_theta = (local.get("rope_theta") or config.get("rope_local_base_freq")
                   or DEFAULTS[arch]["local_theta"] or theta)
    rope = config.get("rope_scaling") or full
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("none", "default"):
        scaling = ()
    elif kind == "linear":
        scaling = ("linear", float(rope["factor"]))
    else:
        raise ModelFileError(path, f"rope scaling {kind!r} is not supported")
    return float(theta), float(local_theta), scaling


def config_from_hf(path, config):
    arch = next(HF_ARCHS[a] for a in config["architectures"] if a in HF_ARCHS)
    defaults = DEFAULTS[arch]
    try:
        n_layers, d_model = int(config["num_hidden_layers"]), int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or d_model // n_heads)
        if config.get("layer_types"):
            sliding = tuple(t == "sliding_attention" for t in config["layer_types"])
        else:
            sliding = sliding_pattern(n_layers, int(config.get("sliding_window_pattern")
                                                    or defaults["pattern"]))
        theta, local_theta, scaling = _hf_rope(path, config, arch)
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ModelFileError(path, f"activation {act!r} is not supported")
        return GemmaConfig(
            arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            d_ff=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            context_length=int(config["max_position_embeddings"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_local_theta=local_theta,
            query_scalar=float(config.get("query_pre_attn_scalar") or head_dim),
            sliding_window=int(config.get("sliding_window") or defaults["window"]),
            sliding=sliding, rope_scaling=scaling,
            attn_softcap=float(config.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(config.get("final_logit_softcapping") or 0.0),
            qk_norm=arch == "gemma3",
            tied_embeddings=bool(config.get("tie_word_embeddings", True)))
    except KeyError as missing:
        raise ModelFileError(path, f"config.json lacks {missing}") from None


# Hugging Face tensor names -> the GGUF names the graph uses.
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name):
    """The GGUF name of a Hugging Face tensor name, or None for tensors the model does not use."""
    return gguf_name_by(hf_name, HF_LAYER_NAMES)


def hf_array(name, array):
    """Gemma's norms scale by 1 + w; safetensors hold w, GGUF files 1 + w (llama.cpp's
    converter adds the 1), which is what the graph reads."""
    return array + np.float32(1.0) if name.endswith("norm.weight") else array


def forward(cfg, weights, num_blocks, block_size, freq_factors=None, part=None, ring_blocks=0):
    """The decoder step as a graph. `weights` maps GGUF tensor names to (shape, dtype);
    `part` (engine/placement.py) makes one device's graph of a group, as llama.forward's does.
    `freq_factors` is always None: config_from_gguf refuses a file that has them.
    `ring_blocks` > 0: the sliding-window layers' caches hold that many blocks of their own,
    read and written through the step input `window_tables` (engine/kvcache.py: Ring)."""
    g = Graph()
    part = part or Part((0, cfg.n_layers))
    tokens, positions, seq_rows, block_tables, sample_tokens = step_inputs(g)
    ringed = ring_blocks and any(cfg.sliding[i] for i in range(*part.layers))
    window_tables = g.input("window_tables", ("S", "B")) if ringed else block_tables
    inv_freq = {local: g.const(f"rope_inv_freq.{'local' if local else 'global'}",
                               cfg.rope_inv_freq(local)) for local in set(cfg.sliding)}

    w = weight_reader(g, weights)

    def norm(x, name, n):
        return g.rms_norm(x, w(name, n), cfg.norm_eps)

    def reduced(partial):
        return g.all_reduce(partial, part.world) if part.world > 1 else partial

    H, Hkv, D, E, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff
    group = H // Hkv
    kv0, kv1 = part.kv_heads or (0, Hkv)
    f0, f1 = part.ff or (0, F)
    q_rows, kv_rows = (kv0 * group * D, kv1 * group * D), (kv0 * D, kv1 * D)
    Hs, Hkvs = (kv1 - kv0) * group, kv1 - kv0
    whole = (kv0, kv1, f0, f1) == (0, Hkv, 0, F)
    if whole:
        q_rows = kv_rows = None
    if part.first:      # sqrt(E) in f32, as llama.cpp (transformers rounds it to the dtype)
        x = g.embedding(w("token_embd.weight", cfg.vocab_size, E), tokens, np.sqrt(E))
    else:
        x = g.input("hidden", ("T", E), "f32")
    for i in range(*part.layers):
        p, local = f"blk.{i}.", cfg.sliding[i]
        # attention block, its output normed before the residual add
        h = norm(x, p + "attn_norm.weight", E)
        q = g.reshape(g.matmul(h, w(p + "attn_q.weight", H * D, E, rows=q_rows)), ("T", Hs, D))
        k = g.reshape(g.matmul(h, w(p + "attn_k.weight", Hkv * D, E, rows=kv_rows)),
                      ("T", Hkvs, D))
        v = g.reshape(g.matmul(h, w(p + "attn_v.weight", Hkv * D, E, rows=kv_rows)),
                      ("T", Hkvs, D))
        if cfg.qk_norm:
            q = norm(q, p + "attn_q_norm.weight", D)
            k = norm(k, p + "attn_k_norm.weight", D)
        q = g.rope(q, positions, inv_freq[local], cfg.rope_style)
        k = g.rope(k, positions, inv_freq[local], cfg.rope_style)
        blocks, tables = (ring_blocks, window_tables) if local and ringed else \
            (num_blocks, block_tables)
        k_cache = g.state_tensor(p + "k_cache", (blocks, block_size, Hkvs, D))
        v_cache = g.state_tensor(p + "v_cache", (blocks, block_size, Hkvs, D))
        g.store_kv(k, v, k_cache, v_cache, positions, seq_rows, tables)
        a = g.attention(q, k_cache, v_cache, positions, seq_rows, tables,
                        cfg.query_scalar ** -0.5, cfg.sliding_window if local else 0,
                        cfg.attn_softcap)
        o = g.matmul(g.reshape(a, ("T", Hs * D)),
                     w(p + "attn_output.weight", E, H * D, cols=q_rows))
        x = g.add(x, norm(reduced(o), p + "post_attention_norm.weight", E))
        # feed-forward block (GeGLU), its output normed before the residual add
        h = norm(x, p + "ffn_norm.weight", E)
        ff = None if whole else (f0, f1)
        gate = g.matmul(h, w(p + "ffn_gate.weight", F, E, rows=ff))
        up = g.matmul(h, w(p + "ffn_up.weight", F, E, rows=ff))
        down = g.matmul(g.glu(gate, up, "gelu_tanh"), w(p + "ffn_down.weight", E, F, cols=ff))
        x = g.add(x, norm(reduced(down), p + "post_ffw_norm.weight", E))
    if not part.last:
        g.output("hidden", x)
        return g
    # only the sampled rows need the final norm and the (large) output projection
    last = g.gather(x, sample_tokens)
    if part.logits:
        g.output("last_hidden", last)
    x = norm(last, "output_norm.weight", E)
    output = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    logits = g.matmul(x, w(output, cfg.vocab_size, E, rows=part.vocab))
    if part.vocab is not None:
        logits = g.all_gather(logits, part.world, cfg.vocab_size)
    if part.logits:         # (a tensor group's other ranks leave the logits to rank 0)
        g.output("logits", g.softcap(logits, cfg.final_softcap) if cfg.final_softcap else logits)
    return g
