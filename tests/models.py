"""Model files for tests: tiny random-weight Llamas and Gemmas written on demand, and the
default model."""
import pytest

from poot.loader import default_model_path
from poot.models.random_weights import write_random_gemma, write_random_llama


def tiny_model(folder, dtype="F16", arch="llama", seed=0, shape=None, mixed=(), tied=False):
    """A 2-layer random Llama GGUF with a real byte-level tokenizer and ChatML template
    (`shape`: another of random_weights.SHAPES); `mixed`: matrices in other dtypes, `tied`: the
    embedding table as the output head (see write_random_llama)."""
    shape = shape or ("tiny" if dtype in ("F32", "F16", "BF16") else "tiny-k")
    kinds = "".join(f"-{name}-{d.lower()}" for name, d in mixed) + "-tied" * tied
    path = folder / f"{shape}-{arch}-{dtype.lower()}{kinds}-{seed}.gguf"
    if not path.exists():
        write_random_llama(path, shape, dtype=dtype, seed=seed, arch=arch, mixed=mixed,
                           tied=tied)
    return path


def tiny_gemma(folder, arch="gemma2", dtype="F16", seed=0):
    """A tiny random Gemma 2 or 3 GGUF with a Gemma-style SentencePiece tokenizer and turn
    template (see write_random_gemma)."""
    path = folder / f"tiny-{arch}-{dtype.lower()}-{seed}.gguf"
    if not path.exists():
        write_random_gemma(path, arch, dtype=dtype, seed=seed)
    return path


def default_model():
    """The default model's path; skips the test when it has not been fetched."""
    path = default_model_path()
    if not path.exists():
        pytest.skip(f"the default model is not at {path}: run scripts/fetch-model")
    return path
