"""OLMo 2 (AI2) in the graph IR: a Llama-shaped decoder whose norms follow its blocks (each
block's output is normed, then added to the residual stream; nothing is normed before a block)
and whose q and k are each normed over all their heads together, before the rope.

Its config is the Llama family's (llama.LlamaConfig, read by the same readers); its weights
are named as in GGUF files, the Hugging Face names mapped onto those.
"""
from ..engine.placement import Part
from ..ir.graph import Graph
from . import llama
from .family import gguf_name_by, step_inputs, weight_reader

GGUF_ARCHS = ("olmo2",)
HF_ARCHS = {"Olmo2ForCausalLM": "olmo2"}

HF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def config_from_gguf(path, metadata, tensor_names):
    return llama.config_from_gguf(path, metadata, tensor_names)


def config_from_hf(path, config):
    return llama.config_from_hf(path, config, HF_ARCHS)


def gguf_name(hf_name):
    """The GGUF name of a Hugging Face tensor name, or None for tensors the model does not use."""
    return gguf_name_by(hf_name, HF_LAYER_NAMES)


def forward(cfg, weights, num_blocks, block_size, freq_factors=None, part=None):
    """The decoder step as a graph (llama.forward's inputs and outputs). `part`: a pipeline
    stage's layers; a tensor group is refused, as q's and k's norms span every head."""
    part = part or Part((0, cfg.n_layers))
    if part.world > 1 or part.kv_heads or part.ff or part.vocab:
        raise ValueError("OLMo 2 is not split over a tensor group: its q and k norms span "
                         "every head")
    g = Graph()
    tokens, positions, seq_rows, block_tables, sample_tokens = step_inputs(g)
    inv_freq = g.const("rope_inv_freq", cfg.rope_inv_freq(freq_factors))
    w = weight_reader(g, weights)
    H, Hkv, D, E, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff

    def norm(x, name, n):
        return g.rms_norm(x, w(name, n), cfg.norm_eps)

    if part.first:
        x = g.embedding(w("token_embd.weight", cfg.vocab_size, E), tokens)
    else:
        x = g.input("hidden", ("T", E), "f32")
    for i in range(*part.layers):
        p = f"blk.{i}."
        # attention block: q and k normed across their heads, then the rope
        q = norm(g.matmul(x, w(p + "attn_q.weight", H * D, E)), p + "attn_q_norm.weight", H * D)
        k = norm(g.matmul(x, w(p + "attn_k.weight", Hkv * D, E)), p + "attn_k_norm.weight",
                 Hkv * D)
        v = g.reshape(g.matmul(x, w(p + "attn_v.weight", Hkv * D, E)), ("T", Hkv, D))
        q = g.rope(g.reshape(q, ("T", H, D)), positions, inv_freq, cfg.rope_style,
                   cfg.rope_scale)
        k = g.rope(g.reshape(k, ("T", Hkv, D)), positions, inv_freq, cfg.rope_style,
                   cfg.rope_scale)
        k_cache = g.state_tensor(p + "k_cache", (num_blocks, block_size, Hkv, D))
        v_cache = g.state_tensor(p + "v_cache", (num_blocks, block_size, Hkv, D))
        g.store_kv(k, v, k_cache, v_cache, positions, seq_rows, block_tables)
        a = g.attention(q, k_cache, v_cache, positions, seq_rows, block_tables, D ** -0.5)
        o = g.matmul(g.reshape(a, ("T", H * D)), w(p + "attn_output.weight", E, H * D))
        x = g.add(x, norm(o, p + "post_attention_norm.weight", E))
        # feed-forward block, normed after
        gate = g.matmul(x, w(p + "ffn_gate.weight", F, E))
        up = g.matmul(x, w(p + "ffn_up.weight", F, E))
        down = g.matmul(g.glu(gate, up, "silu"), w(p + "ffn_down.weight", E, F))
        x = g.add(x, norm(down, p + "post_ffw_norm.weight", E))
    if not part.last:
        g.output("hidden", x)
        return g
    last = g.gather(x, sample_tokens)
    g.output("last_hidden", last)
    x = norm(last, "output_norm.weight", E)
    output = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    g.output("logits", g.matmul(x, w(output, cfg.vocab_size, E)))
    return g


embedding = llama.embedding
