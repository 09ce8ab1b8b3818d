"""OLMo 2 (models/olmo.py) against Hugging Face transformers, as test_llama.py checks the Llama
family: tiny random models built there, saved as safetensors, loaded here, their logits compared
over whole prompts and over chunked prefill with decode in a shared paged cache; a GGUF copy
(llama.cpp's names, no permutation: OLMo 2 ropes in the NeoX layout) too; and on the devices
against the reference."""
import numpy as np
import pytest

import poot
from poot.formats import open_model
from poot.formats.gguf import GGUFFile, write_gguf
from poot.models import olmo
from poot.models.random_weights import CHATML, SPECIALS, byte_level_metadata
from tests.test_llama import Harness, from_folder, hf_logits, rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_olmo(tmp_path, vocab=97, **extra):
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    config = transformers.Olmo2Config(**{**dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=None),
        **extra})
    model = transformers.Olmo2ForCausalLM(config).eval()
    with torch.no_grad():                     # norms away from 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "olmo2", safe_serialization=True)
    return model, tmp_path / "olmo2"


@pytest.mark.parametrize("extra", [{}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}])
def test_prompts_chunks_and_decode_match_transformers(tmp_path, extra):
    model, folder = hf_olmo(tmp_path, **extra)
    cfg, shapes, weight = from_folder(folder, olmo)
    rng = np.random.default_rng()
    a, b = rng.integers(0, 97, 23).tolist(), rng.integers(0, 97, 17).tolist()
    assert rel_err(Harness(cfg, shapes, weight, family=olmo).run([(0, 0, a)]),
                   hf_logits(model, a)) < 1e-4
    harness, got = Harness(cfg, shapes, weight, family=olmo), {0: [], 1: []}
    got[0].append(harness.run([(0, 0, a[:9])]))
    out = harness.run([(0, 9, a[9:20]), (1, 0, b[:6])])
    got[0].append(out[:11]), got[1].append(out[11:])
    out = harness.run([(1, 6, b[6:17]), (0, 20, a[20:23])])
    got[1].append(out[:11]), got[0].append(out[11:])
    assert rel_err(np.concatenate(got[0]), hf_logits(model, a)) < 1e-4
    assert rel_err(np.concatenate(got[1]), hf_logits(model, b)) < 1e-4


def gguf_copy(tmp_path, folder):
    """The model as llama.cpp's converter writes an olmo2 GGUF (F32 tensors), with a byte-level
    tokenizer where its vocabulary holds one."""
    f = open_model(folder)
    cfg = olmo.config_from_hf(folder, f.config)
    tokenizer = byte_level_metadata(cfg.vocab_size, SPECIALS, CHATML, eos=2) \
        if cfg.vocab_size >= 300 else {}
    meta = {"general.architecture": "olmo2", **tokenizer, **{f"olmo2.{k}": v for k, v in {
        "block_count": cfg.n_layers, "context_length": cfg.context_length,
        "embedding_length": cfg.d_model,
        "feed_forward_length": cfg.d_ff, "attention.head_count": cfg.n_heads,
        "attention.head_count_kv": cfg.n_kv_heads, "vocab_size": cfg.vocab_size,
        "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0}.items()}}
    path = tmp_path / "olmo2.gguf"
    write_gguf(path, meta, [(olmo.gguf_name(n), "F32", f.array(n)) for n in f.tensors])
    return path


def test_gguf_copy_matches_transformers(tmp_path):
    model, folder = hf_olmo(tmp_path)
    gguf = GGUFFile(gguf_copy(tmp_path, folder))
    cfg = olmo.config_from_gguf(gguf.path, gguf.metadata, gguf.tensors)
    assert cfg.rope_style == "neox"
    shapes = {n: (t.shape, t.dtype) for n, t in gguf.tensors.items()}
    ids = np.random.default_rng().integers(0, 97, 30).tolist()
    ours = Harness(cfg, shapes, gguf.array, family=olmo).run([(0, 0, ids)])
    assert rel_err(ours, hf_logits(model, ids)) < 1e-4


def test_devices_match_the_reference(tmp_path, device):
    """Greedy tokens and logits on each device against the reference, the GGUF copy loaded as
    a user loads it (a byte-level tokenizer stands in for OLMo's)."""
    from tests.test_device_runner import greedy
    _, folder = hf_olmo(tmp_path, vocab=320, max_position_embeddings=512)
    model = poot.load(gguf_copy(tmp_path, folder))
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 12, table)
    got_ids, got = greedy(model.runner(device, num_blocks=32), [5, 80, 9, 41], 12, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
