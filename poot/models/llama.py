"""The Llama family in the graph IR: Llama 2/3/3.x, Mistral, SmolLM2 and 3, Qwen2/2.5, Qwen3,
ERNIE 4.5 and Granite 3 (their dense models), and the mixtures of experts Mixtral and Qwen3-MoE.

`forward` reads top to bottom as the model's forward pass; the variants are small named switches
in `LlamaConfig` (q/k/v bias for Qwen2, q/k norm for Qwen3, rope layout and frequency scaling:
linear, Llama 3.1's, YaRN's; layers without rope for SmolLM3, Granite's multipliers, tied
embeddings, a feed-forward block of routed experts).
Weights are named as in GGUF files; Hugging Face names are mapped onto those, each expert's
matrix onto its row of the stacked one.
"""
import math
from dataclasses import dataclass

import numpy as np

from ..errors import ModelFileError
from ..engine.placement import Part
from ..ir.graph import Graph
from .family import gguf_name_by, layer_tensor, step_inputs, weight_reader

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "smollm3", "ernie4_5", "granite")
HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
            "MixtralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
            "SmolLM3ForCausalLM": "smollm3", "Ernie4_5ForCausalLM": "ernie4_5",
            "GraniteForCausalLM": "granite"}
# GGUF archs whose rope pairs neighbouring dims
INTERLEAVED = ("llama", "smollm3", "ernie4_5", "granite")
NOPE_INTERVAL = 4           # SmolLM3: every fourth layer has no rope (llama.cpp's, not in GGUF)


@dataclass(frozen=True)
class LlamaConfig:
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
    rope_theta: float
    rope_dim: int
    rope_style: str              # "normal" (GGUF llama layout) or "neox" (HF, GGUF qwen)
    # () | ("linear", factor) | ("llama3", factor, low, high, orig)
    #    | ("yarn", factor, orig, beta_fast, beta_slow, attention_factor, truncate)
    rope_scaling: tuple = ()
    qkv_bias: bool = False       # Qwen2
    qk_norm: bool = False        # Qwen3
    nope_layers: frozenset = frozenset()     # layers whose q and k get no rope (SmolLM3)
    # Granite's multipliers: of the embeddings, of each block's output before it is added to
    # the residual stream, of the attention scores (instead of head_dim ** -0.5), and the
    # divisor of the logits
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: float = 0.0         # 0: head_dim ** -0.5
    logit_scale: float = 1.0
    tied_embeddings: bool = False
    # mixture of experts (Mixtral, Qwen3-MoE): each token's feed-forward block is the weighted
    # sum of experts_used of n_experts SwiGLU blocks (d_ff wide each), chosen by a router
    n_experts: int = 0
    experts_used: int = 0
    norm_topk: bool = True       # the chosen experts' weights renormalised to sum to one

    def rope_inv_freq(self, freq_factors=None):
        """Rotation frequency of each dimension pair, after any frequency scaling."""
        inv = rope_frequencies(self.rope_theta, self.rope_dim)
        if freq_factors is not None:             # GGUF rope_freqs: Llama 3.1 scaling, precomputed
            inv = inv / np.asarray(freq_factors, np.float64)
        elif self.rope_scaling and self.rope_scaling[0] == "linear":
            inv = inv / self.rope_scaling[1]
        elif self.rope_scaling and self.rope_scaling[0] == "llama3":
            inv = llama3_scaled(inv, *self.rope_scaling[1:])
        elif self.rope_scaling and self.rope_scaling[0] == "yarn":
            factor, original, fast, slow, _, truncate = self.rope_scaling[1:]
            inv = yarn_scaled(inv, self.rope_theta, self.rope_dim, factor, original, fast, slow,
                              truncate)
        return inv.astype(np.float32)

    @property
    def rope_scale(self):
        """What the rotated dims are multiplied by: YaRN's attention factor, else 1."""
        return self.rope_scaling[5] if self.rope_scaling[:1] == ("yarn",) else 1.0


def rope_frequencies(theta, rope_dim):
    """RoFormer's rotation frequencies, float64: theta ** (-2i / rope_dim) for each pair i."""
    return 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)


def llama3_scaled(inv, factor, low_factor, high_factor, original_context):
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend between."""
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = original_context / low_factor, original_context / high_factor
    smooth = (original_context / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return np.where(wavelen < high_wavelen, inv, np.where(wavelen > low_wavelen, inv / factor,
                                                          blended))


def yarn_scaled(inv, theta, rope_dim, factor, original_context, beta_fast, beta_slow,
                truncate=True):
    """YaRN (Peng et al. 2023): the pairs that turn fewer than beta_slow times over the original
    context are interpolated (slowed by `factor`), those that turn more than beta_fast times
    kept, a linear ramp between."""
    def pair_of(turns):         # the pair index that turns `turns` times over the context
        return rope_dim * math.log(original_context / (turns * 2 * math.pi)) / (
            2 * math.log(theta))
    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    ramp = np.clip((np.arange(len(inv)) - low) / max(high - low, 0.001), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_attention_factor(factor, mscale=None, mscale_all_dim=None):
    """YaRN's factor on the rotated dims where a config gives none: 0.1 ln(factor) + 1, or the
    ratio of two such with their multipliers (DeepSeek's mscale, mscale_all_dim)."""
    def get(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    return get(mscale) / get(mscale_all_dim) if mscale and mscale_all_dim else get(1.0)


# GGUF rope scaling keys a Llama-family file may hold (after "{arch}.rope.scaling.")
GGUF_ROPE_SCALING = ("type", "factor", "original_context_length", "yarn_beta_fast",
                     "yarn_beta_slow", "finetuned")


def config_from_gguf(path, metadata, tensor_names):
    arch = metadata["general.architecture"]         # one of GGUF_ARCHS (models.gguf_family)

    def key(name, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelFileError(path, f"metadata key {arch}.{name} is missing")
        if isinstance(value, (list, np.ndarray)):     # per-layer values: only uniform ones
            if len(set(np.asarray(value).tolist())) != 1:
                raise ModelFileError(path, f"{arch}.{name} differs between layers")
            value = np.asarray(value).flat[0]
        return value

    d_model, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", d_model // n_heads))
    scaling = ()
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        scaling = ("linear", float(key("rope.scaling.factor")))
    elif kind == "yarn":
        unknown = [k for k in metadata if k.startswith(f"{arch}.rope.scaling.")
                   and k[len(f"{arch}.rope.scaling."):] not in GGUF_ROPE_SCALING]
        if unknown:
            raise ModelFileError(path, f"YaRN scaling with {unknown[0]} is not supported")
        factor = float(key("rope.scaling.factor"))
        scaling = ("yarn", factor, float(key("rope.scaling.original_context_length")),
                   float(key("rope.scaling.yarn_beta_fast", 32.0)),
                   float(key("rope.scaling.yarn_beta_slow", 1.0)),
                   yarn_attention_factor(factor), True)
    elif kind not in ("none", None):
        raise ModelFileError(path, f"rope scaling {kind!r} is not supported")
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    n_experts = int(key("expert_count", 0))
    d_ff = int(key("expert_feed_forward_length" if arch == "qwen3moe" else
                   "feed_forward_length"))
    if n_experts and "blk.0.ffn_gate_exps.weight" not in tensor_names:
        raise ModelFileError(path, "the experts are stored one tensor each (an older "
                                   "conversion); poot reads the stacked ffn_*_exps tensors: "
                                   "convert the model again with a current llama.cpp")
    if arch == "qwen3moe" and not n_experts:
        raise ModelFileError(path, "metadata key qwen3moe.expert_count is missing")
    return LlamaConfig(
        arch=arch, n_layers=int(key("block_count")), d_model=d_model, n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=head_dim,
        d_ff=d_ff, vocab_size=int(vocab),
        context_length=int(key("context_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_dim=int(key("rope.dimension_count", head_dim)),
        rope_style="normal" if arch in INTERLEAVED else "neox", rope_scaling=scaling,
        nope_layers=nope_every(NOPE_INTERVAL if arch == "smollm3" else 0,
                               int(key("block_count"))),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        tied_embeddings="output.weight" not in tensor_names,
        n_experts=n_experts, experts_used=int(key("expert_used_count", 0)) if n_experts else 0,
        norm_topk=bool(key("expert_weights_norm", True)),
        embedding_scale=float(key("embedding_scale", 1.0)),
        residual_scale=float(key("residual_scale", 1.0)),
        attention_scale=float(key("attention.scale", 0.0)),
        logit_scale=float(key("logit_scale", 1.0)))


def config_from_hf(path, config, archs=HF_ARCHS):
    """The LlamaConfig of a config.json (`archs`: its family's HF_ARCHS, for the families that
    share this config: olmo.py)."""
    arch = next(archs[a] for a in config["architectures"] if a in archs)
    try:
        d_model, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or d_model // n_heads)
        context = int(config["max_position_embeddings"])
        if config.get("sliding_window") and config.get("use_sliding_window", True):
            context = min(context, int(config["sliding_window"]))   # beyond it Mistral differs
        # transformers 5 writes rope_parameters (theta inside); earlier ones rope_scaling
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
        kind = rope.get("rope_type", rope.get("type", "none"))
        if kind in ("none", "default"):
            scaling = ()
        elif kind == "linear":
            scaling = ("linear", float(rope["factor"]))
        elif kind == "llama3":
            scaling = ("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                       float(rope["high_freq_factor"]),
                       float(rope["original_max_position_embeddings"]))
        elif kind == "yarn":
            original = float(rope.get("original_max_position_embeddings")
                             or config["max_position_embeddings"])
            factor = float(rope.get("factor") or config["max_position_embeddings"] / original)
            attention = rope.get("attention_factor") or yarn_attention_factor(
                factor, rope.get("mscale"), rope.get("mscale_all_dim"))
            scaling = ("yarn", factor, original, float(rope.get("beta_fast") or 32),
                       float(rope.get("beta_slow") or 1), float(attention),
                       bool(rope.get("truncate", True)))
            context = max(context, int(original * factor))     # what the scaling reaches
        else:
            raise ModelFileError(path, f"rope scaling {kind!r} is not supported")
        n_experts, d_ff = hf_experts(path, arch, config)
        if arch == "ernie4_5" and config.get("use_bias"):
            raise ModelFileError(path, "ERNIE 4.5 with biases (use_bias) is not supported")
        n_layers = int(config["num_hidden_layers"])
        nope = frozenset()
        if arch == "smollm3":
            if config.get("use_sliding_window") and config.get("sliding_window"):
                raise ModelFileError(path, "SmolLM3 with sliding-window layers is not supported")
            roped = config.get("no_rope_layers")    # 1: the layer has rope, 0: it has none
            nope = nope_every(int(config.get("no_rope_layer_interval", NOPE_INTERVAL)),
                              n_layers) if roped is None else frozenset(
                i for i in range(n_layers) if not roped[i])
        return LlamaConfig(
            arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads), head_dim=head_dim,
            d_ff=d_ff,
            vocab_size=int(config["vocab_size"]), context_length=context,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_dim=int(head_dim * config.get("partial_rotary_factor", 1.0)),
            # ERNIE 4.5's checkpoints pair neighbouring dims, as GGUF llama files do
            rope_style="normal" if arch == "ernie4_5" else "neox", rope_scaling=scaling,
            nope_layers=nope,
            qkv_bias=arch == "qwen2" or bool(config.get("attention_bias")),
            qk_norm=arch in ("qwen3", "qwen3moe"),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            n_experts=n_experts,
            experts_used=int(config["num_experts_per_tok"]) if n_experts else 0,
            norm_topk=bool(config.get("norm_topk_prob", True)),
            embedding_scale=float(config.get("embedding_multiplier", 1.0)),
            residual_scale=float(config.get("residual_multiplier", 1.0)),
            attention_scale=float(config.get("attention_multiplier", 0.0)),
            logit_scale=float(config.get("logits_scaling", 1.0)))
    except KeyError as missing:
        raise ModelFileError(path, f"config.json lacks {missing}") from None


def nope_every(interval, n_layers):
    """The layers without rope when every `interval`-th has none (0: none lacks it)."""
    return frozenset(i for i in range(n_layers) if interval and (i + 1) % interval == 0)


def hf_experts(path, arch, config):
    """(experts, each one's d_ff) of a config.json: Mixtral's num_local_experts of
    intermediate_size, Qwen3-MoE's num_experts of moe_intermediate_size on every layer (its
    dense layers, mlp_only_layers or a decoder_sparse_step past 1, are refused); (0, d_ff) for
    a dense model."""
    n_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if arch != "qwen3moe":
        return n_experts, int(config["intermediate_size"])
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise ModelFileError(path, "Qwen3-MoE with dense layers (mlp_only_layers, "
                                   "decoder_sparse_step) is not supported")
    if not n_experts:
        raise ModelFileError(path, "config.json lacks num_experts")
    return n_experts, int(config["moe_intermediate_size"])


# Hugging Face tensor names -> the GGUF names the graph uses.
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# A layer's experts, one tensor each in Hugging Face files (Qwen3-MoE's mlp.experts.N.*, Mixtral's
# block_sparse_moe.experts.N.w1/w3/w2), are rows of one stacked GGUF tensor [experts, ...].
HF_EXPERT_NAMES = {
    ("mlp", "gate_proj.weight"): "ffn_gate_exps.weight",
    ("mlp", "up_proj.weight"): "ffn_up_exps.weight",
    ("mlp", "down_proj.weight"): "ffn_down_exps.weight",
    ("block_sparse_moe", "w1.weight"): "ffn_gate_exps.weight",
    ("block_sparse_moe", "w3.weight"): "ffn_up_exps.weight",
    ("block_sparse_moe", "w2.weight"): "ffn_down_exps.weight",
}
HF_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")


def gguf_name(hf_name):
    """The GGUF name of a Hugging Face tensor name, or None for tensors the model does not use;
    for one expert's matrix, (the stacked tensor's GGUF name, the expert's index)."""
    name = gguf_name_by(hf_name, HF_LAYER_NAMES)
    if name is not None or layer_tensor(hf_name) is None:
        return name
    layer, rest = layer_tensor(hf_name)
    if rest in HF_ROUTERS:
        return f"blk.{layer}.ffn_gate_inp.weight"
    block, experts, index, *matrix = rest.split(".")
    name = HF_EXPERT_NAMES.get((block, ".".join(matrix)))
    if experts == "experts" and index.isdigit() and name:
        return f"blk.{layer}.{name}", int(index)
    return None


def forward(cfg, weights, num_blocks, block_size, freq_factors=None, part=None):
    """The decoder step as a graph. `weights` maps GGUF tensor names to (shape, dtype).

    `part` (engine/placement.py) makes the graph of one device of a group: its layers, its
    slice of the heads and feed-forward columns (weights declared with the slice they take of
    the file's tensor, and an all_reduce of the partial sums after each block), whether it
    embeds the tokens (else it reads the input "hidden") and computes the output head (else its
    output is "hidden"), and its rows of the head: the group's slices of the logits are
    gathered, and only rank 0 outputs them. Without one, the whole model."""
    g = Graph()
    tokens, positions, seq_rows, block_tables, sample_tokens = step_inputs(g)
    inv_freq = g.const("rope_inv_freq", cfg.rope_inv_freq(freq_factors))

    w = weight_reader(g, weights)

    def project(x, name, n_out, rows):
        y = g.matmul(x, w(f"{name}.weight", n_out, x.shape[-1], rows=rows))
        return g.add(y, w(f"{name}.bias", n_out, rows=rows)) if cfg.qkv_bias else y

    def reduced(partial):
        """A block's output as the residual stream takes it: summed over a tensor group,
        times Granite's multiplier."""
        whole = g.all_reduce(partial, part.world) if part.world > 1 else partial
        return whole if cfg.residual_scale == 1 else g.scale(whole, cfg.residual_scale)

    def experts(h, p):
        """The router's softmax chooses experts_used experts of each token; the block is the
        weighted sum of their SwiGLU blocks."""
        X, K = cfg.n_experts, cfg.experts_used
        router = g.matmul(h, w(p + "ffn_gate_inp.weight", X, E))
        ids = g.top_k(router, K)
        weights = g.route_weights(router, ids, cfg.norm_topk)
        gate = g.expert_matmul(h, w(p + "ffn_gate_exps.weight", X, F, E), ids)
        up = g.expert_matmul(h, w(p + "ffn_up_exps.weight", X, F, E), ids)
        down = g.expert_matmul(g.glu(gate, up, "silu"), w(p + "ffn_down_exps.weight", X, E, F),
                               ids)
        return g.expert_sum(down, weights)

    part = part or Part((0, cfg.n_layers))
    H, Hkv, D, E, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff
    group = H // Hkv
    kv0, kv1 = part.kv_heads or (0, Hkv)
    f0, f1 = part.ff or (0, F)
    q_rows, kv_rows = (kv0 * group * D, kv1 * group * D), (kv0 * D, kv1 * D)
    Hs, Hkvs = (kv1 - kv0) * group, kv1 - kv0
    whole = (kv0, kv1, f0, f1) == (0, Hkv, 0, F)
    if cfg.n_experts and not whole:
        raise ValueError("a mixture of experts is not split over a tensor group")
    if whole:
        q_rows = kv_rows = None
    if part.first:
        x = g.embedding(w("token_embd.weight", cfg.vocab_size, E), tokens, cfg.embedding_scale)
    else:
        x = g.input("hidden", ("T", E), "f32")
    for i in range(*part.layers):
        p = f"blk.{i}."
        # attention block
        h = g.rms_norm(x, w(p + "attn_norm.weight", E), cfg.norm_eps)
        q = g.reshape(project(h, p + "attn_q", H * D, q_rows), ("T", Hs, D))
        k = g.reshape(project(h, p + "attn_k", Hkv * D, kv_rows), ("T", Hkvs, D))
        v = g.reshape(project(h, p + "attn_v", Hkv * D, kv_rows), ("T", Hkvs, D))
        if cfg.qk_norm:
            q = g.rms_norm(q, w(p + "attn_q_norm.weight", D), cfg.norm_eps)
            k = g.rms_norm(k, w(p + "attn_k_norm.weight", D), cfg.norm_eps)
        if i not in cfg.nope_layers:
            q = g.rope(q, positions, inv_freq, cfg.rope_style, cfg.rope_scale)
            k = g.rope(k, positions, inv_freq, cfg.rope_style, cfg.rope_scale)
        k_cache = g.state_tensor(p + "k_cache", (num_blocks, block_size, Hkvs, D))
        v_cache = g.state_tensor(p + "v_cache", (num_blocks, block_size, Hkvs, D))
        g.store_kv(k, v, k_cache, v_cache, positions, seq_rows, block_tables)
        a = g.attention(q, k_cache, v_cache, positions, seq_rows, block_tables,
                        cfg.attention_scale or D ** -0.5)
        o = g.matmul(g.reshape(a, ("T", Hs * D)),
                     w(p + "attn_output.weight", E, H * D, cols=q_rows))
        x = g.add(x, reduced(o))
        # feed-forward block
        h = g.rms_norm(x, w(p + "ffn_norm.weight", E), cfg.norm_eps)
        if cfg.n_experts:
            x = g.add(x, reduced(experts(h, p)))
            continue
        ff = None if whole else (f0, f1)
        gate = g.matmul(h, w(p + "ffn_gate.weight", F, E, rows=ff))
        up = g.matmul(h, w(p + "ffn_up.weight", F, E, rows=ff))
        x = g.add(x, reduced(g.matmul(g.glu(gate, up, "silu"),
                                      w(p + "ffn_down.weight", E, F, cols=ff))))
    if not part.last:
        g.output("hidden", x)
        return g
    # only the sampled rows need the final norm and the (large) output projection
    last = g.gather(x, sample_tokens)
    if part.logits:
        g.output("last_hidden", last)       # what embeddings pool (embedding() below)
    x = g.rms_norm(last, w("output_norm.weight", E), cfg.norm_eps)
    output = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    logits = g.matmul(x, w(output, cfg.vocab_size, E, rows=part.vocab))
    if cfg.logit_scale != 1:
        logits = g.scale(logits, 1 / cfg.logit_scale)
    if part.vocab is not None:
        logits = g.all_gather(logits, part.world, cfg.vocab_size)
    if part.logits:
        g.output("logits", logits)
    return g



def embedding(cfg, weight_array, last_hidden):
    """A prompt's embedding from its last token's final hidden state (the graph's output
    "last_hidden"): the output norm's scale, then unit length (the norm's division by the RMS
    is a scale the unit length takes out). The last token is what a causal decoder's
    embedding models pool: it alone has attended to the whole prompt."""
    x = np.asarray(last_hidden, np.float64) * weight_array("output_norm.weight")
    return (x / max(np.linalg.norm(x), 1e-12)).astype(np.float32)
