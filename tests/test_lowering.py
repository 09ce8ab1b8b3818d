"""The lowering on its own: a step graph in, launch steps and arena slots out, with no device."""
import pytest

import poot
from poot.engine.lowering import Matvec, assign_slots, lower, part_rows, shared_buffers
from tests.models import tiny_model


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    model = poot.load(tiny_model(tmp_path_factory.mktemp("tiny"), dtype="Q8_0"))
    return model.step_graph(num_blocks=32, block_size=16)


def launched(steps):
    return [s.kind for s in steps if s.kind != "reshape"]


def test_a_llama_layer_lowers_to_six_steps(graph):
    """attn_norm folded into one q/k/v matmul over the stacked weight, rope with store_kv,
    attention, the output projection with its residual, ffn_norm folded into gate/up with the
    SwiGLU, down with its residual."""
    steps, stacked = lower(graph)
    layers = sum(1 for name in graph.weights if name.endswith("attn_q.weight"))
    layer = ["matmul", "rope_store_kv", "attention", "matmul", "matmul", "matmul"]
    assert launched(steps) == ["embedding", *layer * layers, "gather", "matmul"]
    qkv = next(s for s in steps if isinstance(s, Matvec) and len(s.outputs) == 3)
    assert qkv.weight.name == "blk.0.attn_q.weight+blk.0.attn_k.weight+blk.0.attn_v.weight"
    assert qkv.norm.name == "blk.0.attn_norm.weight"
    swiglu = next(s for s in steps if isinstance(s, Matvec) and s.up is not None)
    assert swiglu.weight.name == "blk.0.ffn_gate.weight" and swiglu.norm is not None
    assert sum(s.residual is not None for s in steps if isinstance(s, Matvec)) == 2 * layers
    assert set(stacked) == {s.weight.name for s in steps
                            if isinstance(s, Matvec) and "+" in s.weight.name}


def test_qwen3_head_norms_fold_into_rope_store_kv(tmp_path):
    """Qwen3's q and k norms (over each head) go into the rope_store_kv step: q's pre-norm
    input, rotated in place, k's read; the norms' weights its last inputs, their eps an
    attribute."""
    model = poot.load(tiny_model(tmp_path, dtype="F16", arch="qwen3"))
    steps, _ = lower(model.step_graph(num_blocks=32, block_size=16))
    assert "rms_norm" not in launched(steps)
    fused = [s for s in steps if s.kind == "rope_store_kv"]
    assert len(fused) == model.config.n_layers
    assert [t.name for t in fused[0].inputs[-2:]] == ["blk.0.attn_q_norm.weight",
                                                     "blk.0.attn_k_norm.weight"]
    assert fused[0].attrs["eps"] == model.config.norm_eps


def test_stacking_the_swiglu_makes_gate_and_up_one_weight(graph):
    steps, stacked = lower(graph, stack_glu=True)
    whole, parts = stacked["blk.0.ffn_gate.weight+blk.0.ffn_up.weight"]
    assert [p.name for p in parts] == ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]
    assert whole.shape == (2 * parts[0].shape[0], parts[0].shape[1])
    rows = part_rows(stacked)
    assert rows["blk.0.ffn_up.weight"] == (whole, parts[0].shape[0])
    assert launched(steps) == launched(lower(graph)[0])


def test_arena_slots_never_hold_two_live_values(graph):
    """A value's slot is its own from its step to its last reader (aliases of it included),
    and slots are reused: far fewer than values."""
    steps, _ = lower(graph)
    sizes = {"T": 64, "R": 8}

    def elements(shape):
        n = 1
        for d in shape:
            n *= sizes.get(d, d)
        return n
    uses, slot_of, slot_sizes = assign_slots(steps, graph.outputs.values(),
                                             shared_buffers(graph), elements)
    born, last = {}, {}
    for i, op in enumerate(steps):
        for t in op.inputs:
            if t.name in slot_of:
                last[t.name] = i
        for t in op.outputs:
            if t.name in slot_of:
                born.setdefault(t.name, i)
    for t in graph.outputs.values():
        last[t.name] = len(steps)
    by_slot = {}
    for name, slot in slot_of.items():
        by_slot.setdefault(slot, []).append(name)
        assert elements(next(t for op in steps for t in op.outputs if t.name == name).shape) \
            * 4 <= slot_sizes[slot]
    for names in by_slot.values():
        spans = sorted((born[n], last.get(n, born[n]), n) for n in names)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            shared = steps[start].kind in ("reshape", "rope", "rope_store_kv") and \
                any(t.name == a or slot_of.get(t.name) == slot_of[a] for t in steps[start].inputs)
            assert end <= start or shared, (a, b)
    assert len(slot_sizes) < len(slot_of) / 2
    assert uses["blk.0.attn_norm.weight"] == 1
