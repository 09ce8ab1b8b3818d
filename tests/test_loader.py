"""Loading checks what it can before any device sees the model."""
import numpy as np
import pytest

import poot
from poot.errors import ModelFileError
from poot.formats.gguf import GGUFFile, write_gguf
from tests.models import tiny_model


def rewrite(src, dst, drop=(), reshape=None, meta=None):
    """A copy of GGUF `src` without some tensors, with one tensor's shape changed, or other
    metadata."""
    f = GGUFFile(src)
    metadata = dict(f.metadata, **(meta or {}))
    tensors = []
    for name, info in f.tensors.items():
        if name in drop:
            continue
        values = f.array(name)
        if reshape and name == reshape[0]:
            values = np.resize(values, reshape[1])
        tensors.append((name, "F32", values))
    write_gguf(dst, metadata, tensors)
    return dst


def test_missing_tensor_is_named(tmp_path):
    bad = rewrite(tiny_model(tmp_path), tmp_path / "bad.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelFileError, match=r"bad\.gguf.*blk\.1\.ffn_up\.weight.*missing"):
        poot.load(bad)


def test_wrong_shape_is_named(tmp_path):
    bad = rewrite(tiny_model(tmp_path), tmp_path / "bad.gguf",
                  reshape=("blk.0.attn_k.weight", (16, 64)))
    with pytest.raises(ModelFileError, match=r"blk\.0\.attn_k\.weight.*shape"):
        poot.load(bad)


def test_unsupported_architecture(tmp_path):
    bad = rewrite(tiny_model(tmp_path), tmp_path / "bad.gguf",
                  meta={"general.architecture": "mamba"})
    with pytest.raises(ModelFileError, match="architecture 'mamba' is not supported"):
        poot.load(bad)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_random_models_of_each_arch_load_and_run(tmp_path, arch):
    model = poot.load(tiny_model(tmp_path, arch=arch))
    assert model.config.arch == arch
    assert model.config.qkv_bias == (arch == "qwen2") and model.config.qk_norm == (arch == "qwen3")
    llm = poot.LLM(model.path, backend="reference")
    out = llm.generate("The quick brown fox", max_tokens=6, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
