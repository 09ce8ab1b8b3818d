"""The activations of gated linear units, each written once in the kernel language.

A gated unit (the graph IR's `glu`) is activation(gate) * up: SwiGLU with silu (Llama, Qwen,
Mistral), GeGLU with the tanh approximation of GELU (Gemma). Every kernel that computes one
(the matvec and mma_vec epilogues, split_sum's, the elementwise kernel) takes it from `glu`, and
names itself by the unit's name, so a new activation is one function here, its name, and its
twin in ir/reference.py's ACTIVATIONS.
"""
import math


def silu(k, x):
    return x / (1.0 + k.exp(-x))


def gelu_tanh(k, x):
    """GELU's tanh approximation, 0.5 x (1 + tanh(z)), as x / (1 + exp(-2 z)): the same value,
    from exp, which every target computes to near float precision (PTX's tanh is approximate)."""
    z = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return x / (1.0 + k.exp(-2.0 * z))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
UNITS = {"silu": "swiglu", "gelu_tanh": "geglu"}       # the gated unit's name in kernel names


def glu(k, activation, gate, up):
    """A gated unit's value of a gate and an up value."""
    return ACTIVATIONS[activation](k, gate) * up
