"""The model families poot runs, found by the names files give them.

A family is one module here: its config readers (`config_from_gguf(path, metadata,
tensor_names)`, `config_from_hf(path, config)`), the GGUF name of each Hugging Face tensor it
uses (`gguf_name`) and, where they differ, the values a GGUF file holds for it
(`hf_array(gguf_name, array)`: Gemma's norms are w in safetensors and 1 + w in GGUF), the names it answers to (`GGUF_ARCHS`:
general.architecture values; `HF_ARCHS`: {config.json architecture: arch}), its forward pass
in the graph IR (`forward(config, weights, num_blocks, block_size, freq_factors, part)`, whose
outputs are "logits" and "last_hidden") and the embedding it makes of a last hidden state
(`embedding(config, weight_array, last_hidden)`); optionally the texts of the tokens that end a
turn of its chat format (`END_OF_TURN`), which end generation too. The loader asks this
registry for a file's family and knows nothing of any one of them.
"""
from ..errors import ModelFileError
from . import gemma, llama, olmo, phi3
from .family import MissingWeight, WrongShape

__all__ = ["FAMILIES", "gguf_family", "hf_family", "MissingWeight", "WrongShape"]

FAMILIES = (llama, phi3, gemma, olmo)


def gguf_family(path, metadata):
    """The family of a GGUF file, by its general.architecture."""
    arch = metadata.get("general.architecture")
    for family in FAMILIES:
        if arch in family.GGUF_ARCHS:
            return family
    names = [a for family in FAMILIES for a in family.GGUF_ARCHS]
    raise ModelFileError(path, f"architecture {arch!r} is not supported "
                               f"(supported: {', '.join(names)})")


def hf_family(path, config):
    """The family of a Hugging Face folder, by config.json's architectures."""
    archs = config.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.HF_ARCHS for a in archs):
            return family
    names = [a for family in FAMILIES for a in family.HF_ARCHS]
    raise ModelFileError(path, f"architectures {archs} are not supported "
                               f"(supported: {', '.join(names)})")

