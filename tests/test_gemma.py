"""The Gemma 2 and Gemma 3 graphs, interpreted by the reference, against Hugging Face
transformers.

Tiny random models of each generation are built in transformers (eager attention, so its
sliding-window mask and soft-capping are the plain definitions), saved as safetensors, loaded
here, and their logits compared over prompts longer than the window, chunked prefill with
decode over a shared paged cache, and a GGUF copy written with gguf-py's writer as llama.cpp's
converter writes Gemma (norms stored as 1 + w, its metadata keys, its tensor names).
"""
import json
import pathlib

import numpy as np
import pytest

import poot
from poot.formats import open_model
from poot.formats.gguf import GGUFFile
from poot.models import gemma, hf_family
from tests.models import tiny_gemma
from tests.test_device_runner import greedy, prefill_of, split_runner, step
from tests.test_group import group, one_device, same_greedy  # noqa: F401  (fixtures)
from tests.test_llama import Harness, hf_logits, rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
              rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=8,
              attn_implementation="eager")
VARIANTS = {
    # every other layer slides; scores and logits capped low enough to bend them
    "gemma2": dict(num_hidden_layers=3, attn_logit_softcapping=4.0, final_logit_softcapping=3.0),
    # five sliding layers, then a global one with its own rope base and linear scaling
    "gemma3": dict(num_hidden_layers=6, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def hf_model(tmp_path, arch):
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    classes = {"gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
               "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]
    model = classes[1](classes[0](**COMMON, **VARIANTS[arch])).eval()
    with torch.no_grad():                     # norms away from 0 (a gain of 1 + w)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp_path / arch
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def from_folder(folder):
    f = open_model(folder)
    assert hf_family(folder, f.config) is gemma
    names = {gemma.gguf_name(n): n for n in f.tensors if gemma.gguf_name(n)}
    cfg = gemma.config_from_hf(folder, f.config)
    shapes = {g: (f.tensors[n].shape, f.tensors[n].dtype) for g, n in names.items()}
    return cfg, shapes, lambda g: gemma.hf_array(g, f.array(names[g]))


@pytest.mark.parametrize("arch", VARIANTS)
def test_whole_prompt_matches_transformers(tmp_path, arch):
    model, folder = hf_model(tmp_path, arch)
    cfg, shapes, weight = from_folder(folder)
    ids = np.random.default_rng().integers(0, VOCAB, 30).tolist()     # past the window of 8
    ours = Harness(cfg, shapes, weight, family=gemma).run([(0, 0, ids)])
    assert rel_err(ours, hf_logits(model, ids)) < 1e-4


@pytest.mark.parametrize("arch", VARIANTS)
def test_chunked_prefill_decode_and_batching_match(tmp_path, arch):
    """Two sequences share one paged cache (blocks of 4, the window 8): prefill in uneven
    chunks, then decode together, so windows start inside blocks and chunks."""
    model, folder = hf_model(tmp_path, arch)
    cfg, shapes, weight = from_folder(folder)
    rng = np.random.default_rng()
    a, b = rng.integers(0, VOCAB, 23).tolist(), rng.integers(0, VOCAB, 17).tolist()
    harness = Harness(cfg, shapes, weight, family=gemma)
    got = {0: [], 1: []}
    got[0].append(harness.run([(0, 0, a[:9])]))
    out = harness.run([(0, 9, a[9:20]), (1, 0, b[:6])])
    got[0].append(out[:11]), got[1].append(out[11:])
    out = harness.run([(1, 6, b[6:15]), (0, 20, a[20:21])])
    got[1].append(out[:9]), got[0].append(out[9:])
    for i in range(2):
        out = harness.run([(0, 21 + i, a[21 + i:22 + i]), (1, 15 + i, b[15 + i:16 + i])])
        got[0].append(out[:1]), got[1].append(out[1:])
    assert rel_err(np.concatenate(got[0]), hf_logits(model, a)) < 1e-4
    assert rel_err(np.concatenate(got[1]), hf_logits(model, b)) < 1e-4


def write_converted_gguf(path, arch, folder):
    """The model as llama.cpp's converter writes it: gguf-py's names and keys, norms + 1,
    no output.weight (tied), query_pre_attn_scalar not written (head_dim is what a reader
    takes for a model of this size)."""
    f = open_model(folder)
    hp = f.config
    arch_id = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}[arch]
    names = gguf.get_tensor_name_map(arch_id, hp["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_vocab_size(VOCAB)                 # (a converted file has its token list instead)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    else:
        full = hp["rope_parameters"]["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    for name in f.tensors:
        if name == "lm_head.weight":
            continue
        array = f.array(name).astype(np.float32)
        if name.endswith("norm.weight"):
            array = array + 1
        gname = names.get_name(name.removesuffix(".weight")) + ".weight"
        assert gname == gemma.gguf_name(name)
        w.add_tensor(gname, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", VARIANTS)
def test_gguf_as_converted_matches_transformers(tmp_path, arch):
    model, folder = hf_model(tmp_path, arch)
    model.config.query_pre_attn_scalar = model.config.head_dim     # what a GGUF reader takes
    for layer in model.model.layers:
        layer.self_attn.scaling = model.config.head_dim ** -0.5
    write_converted_gguf(tmp_path / "m.gguf", arch, folder)
    f = GGUFFile(tmp_path / "m.gguf")
    cfg = gemma.config_from_gguf(f.path, f.metadata, f.tensors)
    hf_cfg = gemma.config_from_hf(folder, open_model(folder).config)
    assert cfg.sliding == hf_cfg.sliding and cfg.vocab_size == VOCAB and cfg.tied_embeddings
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == \
        (hf_cfg.rope_theta, hf_cfg.rope_local_theta, hf_cfg.rope_scaling)
    assert (cfg.attn_softcap, cfg.final_softcap) == (hf_cfg.attn_softcap, hf_cfg.final_softcap)
    shapes = {n: (t.shape, t.dtype) for n, t in f.tensors.items()}
    ids = np.random.default_rng().integers(0, VOCAB, 30).tolist()
    ours = Harness(cfg, shapes, f.array, family=gemma).run([(0, 0, ids)])
    assert rel_err(ours, hf_logits(model, ids)) < 1e-4


# config.json of a released Gemma 3 1B and Gemma 2 2B (transformers 4 fields: no layer_types,
# no rope_parameters), the parts a config reader reads
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
             "intermediate_size": 6912, "max_position_embeddings": 32768,
             "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
             "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
             "sliding_window_pattern": 6, "vocab_size": 262144,
             "final_logit_softcapping": None, "attn_logit_softcapping": None}
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
             "final_logit_softcapping": 30.0, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
             "intermediate_size": 9216, "max_position_embeddings": 8192,
             "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
             "sliding_window": 4096, "vocab_size": 256000}


def test_released_configs_read_as_their_models_run():
    g3 = gemma.config_from_hf("gemma-3-1b", json.loads(json.dumps(GEMMA3_1B)))
    assert g3.sliding == tuple(i % 6 != 5 for i in range(26))
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling) == (1e6, 1e4, ())
    assert (g3.sliding_window, g3.query_scalar, g3.qk_norm, g3.tied_embeddings) == \
        (512, 256.0, True, True)
    assert (g3.attn_softcap, g3.final_softcap) == (0.0, 0.0)
    g2 = gemma.config_from_hf("gemma-2-2b", GEMMA2_2B)
    assert g2.sliding == tuple(i % 2 == 0 for i in range(26))
    assert (g2.rope_theta, g2.rope_local_theta) == (1e4, 1e4)
    assert (g2.attn_softcap, g2.final_softcap, g2.qk_norm) == (50.0, 30.0, False)
    scaled = dict(GEMMA3_1B, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert gemma.config_from_hf("gemma-3-4b", scaled).rope_scaling == ("linear", 8.0)


def test_gguf_defaults_are_llama_cpps():
    """What a Gemma GGUF may leave out: Gemma 2's caps and pattern, Gemma 3's rope bases;
    the 27B models' query scale d_model / n_heads."""
    def meta(arch, layers):
        return {"general.architecture": arch, f"{arch}.block_count": layers,
                f"{arch}.embedding_length": 4608, f"{arch}.attention.head_count": 32,
                f"{arch}.attention.head_count_kv": 16, f"{arch}.attention.key_length": 128,
                f"{arch}.feed_forward_length": 36864, f"{arch}.context_length": 8192,
                f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": 256000}
    g2 = gemma.config_from_gguf("m.gguf", meta("gemma2", 46), {})
    assert (g2.attn_softcap, g2.final_softcap, g2.sliding_window) == (50.0, 30.0, 4096)
    assert g2.sliding[:4] == (True, False, True, False) and g2.query_scalar == 144.0
    assert gemma.config_from_gguf("m.gguf", meta("gemma2", 42), {}).query_scalar == 128.0
    g3 = gemma.config_from_gguf("m.gguf", meta("gemma3", 26), {"blk.0.attn_q_norm.weight"})
    assert (g3.rope_theta, g3.rope_local_theta, g3.final_softcap, g3.qk_norm) == \
        (1e6, 1e4, 0.0, True)


def test_unsupported_rope_scaling_is_a_model_file_error():
    from poot.errors import ModelFileError
    bad = dict(GEMMA3_1B, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelFileError, match="yarn"):
        gemma.config_from_hf("gemma-3", bad)


def test_window_and_softcap_attention_reference_by_definition():
    """The reference attention's window and cap, against a direct loop over one sequence."""
    from poot.ir.reference import attention
    rng = np.random.default_rng()
    T, H, Hkv, D, block, window, cap = 11, 4, 2, 8, 4, 3, 2.0
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    keys = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    values = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    table = rng.permutation(8)[:3]
    k_cache = np.full((8, block, Hkv, D), np.nan, np.float32)
    v_cache = k_cache.copy()
    for t in range(T):
        k_cache[table[t // block], t % block] = keys[t]
        v_cache[table[t // block], t % block] = values[t]
    got = attention(q, k_cache, v_cache, np.arange(T, dtype=np.int32), np.zeros(T, np.int32),
                    table[None].astype(np.int32), 0.5, window, cap)
    for t in range(T):
        for h in range(H):
            seen = range(max(0, t - window + 1), t + 1)
            s = np.array([cap * np.tanh(0.5 * q[t, h] @ keys[j, h // 2] / cap) for j in seen])
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ values[list(seen), h // 2]
            assert np.allclose(got[t, h], want, atol=1e-5)


# -- a tiny Gemma through the device runner ---------------------------------------------------
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_on_the_device_gives_the_reference_tokens(tmp_path, device, arch):
    """Greedy decode past the window of 8 (blocks of 16): scaled embeddings, post-norms,
    sliding and global layers, soft-capped scores and logits (Gemma 2), q/k norms (Gemma 3)."""
    model = poot.load(tiny_gemma(tmp_path, arch))
    assert model.family is gemma and any(model.config.sliding)
    table = list(np.random.default_rng().permutation(32))
    prompt = model.tokenizer.encode("The quick brown fox")
    want_ids, want = greedy(model.runner(None, num_blocks=32), prompt, 20, table)
    runner = model.runner(device, num_blocks=32)
    # the post-norms' adds and Gemma 3's q/k norms fold into other launches
    assert not {"add", "rms_norm"} & {s.kind for s in runner.steps if s.kind != "rms_norm" or
                                     not s.attrs.get("residual")}
    got_ids, got = greedy(runner, prompt, 20, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3   # f16 KV cache


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_prefill_and_split_decode_match_reference(tmp_path, device, arch):
    """A 40-token prefill (on ptx: the tensor-core tiles, with their window and cap), then
    decode with attention split every 16 tokens (splits before the window scan nothing)."""
    model = poot.load(tiny_gemma(tmp_path, arch))
    batch = prefill_of(40)
    want = model.runner(None, num_blocks=16).logits(batch)
    got = model.runner(device, num_blocks=16, max_tokens=128).logits(batch)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
    table = list(np.random.default_rng().permutation(32))
    prompt = np.random.default_rng().integers(10, 300, 16).tolist()
    runner = split_runner(model, device, 32, 16)
    want_ids, want = greedy(model.runner(None, num_blocks=32), prompt, 30, table)
    ids = prompt + want_ids
    got = [runner.logits(step(prompt, 0, table))[-1]]
    got += [runner.logits(step(ids[n - 1:n], n - 1, table))[0]
            for n in range(len(prompt) + 1, len(ids))]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


# -- Gemma's tokenizer conventions, with sentencepiece as the oracle ---------------------------
GEMMA_TEXT = ("The capital of France is Paris.\n  Two  spaces,\ttabs and 12345 digits; "
              "café, naïve, 東京, emoji 🙂 and a trailing space ")


def sentencepiece_gguf(tmp_path):
    """A SentencePiece BPE trained with Gemma's settings (byte fallback, no dummy prefix, no
    normalisation, digits split, the turn markers as symbols of their own), and the GGUF
    metadata llama.cpp's converter makes of it (pieces, scores, types; the turn markers
    control tokens, as Gemma's tokenizer_config marks them special)."""
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([GEMMA_TEXT.replace("🙂", "").replace("東京", "")] * 3 + [
        "The quick brown fox jumps over the lazy dog.", "Hello, world! Hello again.",
        "It is a truth universally acknowledged, that a single man in possession"]))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), model_type="bpe", vocab_size=420,
        byte_fallback=True, add_dummy_prefix=False, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, pad_id=0, eos_id=1, bos_id=2,
        unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        character_coverage=1.0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
             else 6 if sp.is_byte(i) else 1 for i in range(len(pieces))]
    for i, piece in enumerate(pieces):
        if piece in ("<start_of_turn>", "<end_of_turn>"):
            types[i] = 3
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False}
    return sp, meta


def test_gemma_sentencepiece_encoding_matches_sentencepiece(tmp_path):
    from poot.text.tokenizer import Tokenizer
    sp, meta = sentencepiece_gguf(tmp_path)
    tok = Tokenizer.from_gguf(meta)
    texts = [GEMMA_TEXT, " leading space", "no prefix", "x" * 7 + " 2024-12-02",
             "\n\nnew lines\n", "unseen: ß ∑ 🙂🙂 ½", "<start_of_turn>user\nHi there<end_of_turn>\n"]
    for text in texts:
        want = sp.encode(text)
        assert tok.encode(text) == [2] + want, text
        assert tok.encode(text, add_special=False) == want, text
        assert tok.decode(want) == sp.decode(want) == text
    byte_ids = {sp.piece_to_id(f"<0x{b:02X}>") for b in "🙂".encode()}
    assert byte_ids <= set(tok.encode("🙂"))                     # byte fallback, no <unk>


def test_gemma_turn_markers_and_end_of_generation(tmp_path):
    """The chat template's turn markers become single control tokens, and the template's own
    <bos> is the only one (chat prompts are encoded without adding specials)."""
    from poot.text.chat import ChatTemplate
    from poot.text.tokenizer import Tokenizer
    sp, meta = sentencepiece_gguf(tmp_path)
    tok = Tokenizer.from_gguf(meta)
    start, end = sp.piece_to_id("<start_of_turn>"), sp.piece_to_id("<end_of_turn>")
    assert tok.eos_ids == {1}     # <end_of_turn> is the family's (test_random_gemma_file...)
    template = (pathlib.Path(__file__).parent / "data/chat_templates/gemma-3-it.jinja")
    chat = ChatTemplate(template.read_text(), bos_token="<bos>", eos_token="<eos>")
    text = chat.render([{"role": "user", "content": "Hello"},
                        {"role": "assistant", "content": "Hi"},
                        {"role": "user", "content": "Bye"}], add_generation_prompt=True)
    ids = tok.encode(text, add_special=False)
    assert ids[0] == 2 and ids.count(2) == 1
    assert ids.count(start) == 4 and ids.count(end) == 3
    tail = [start] + sp.encode("model\n")
    assert ids[-len(tail):] == tail
    assert tok.decode(ids, skip_special=True) == text.replace("<bos>", "").replace(
        "<start_of_turn>", "").replace("<end_of_turn>", "")


def test_random_gemma_file_tokenizes_as_gemma(tmp_path):
    """The tiny random Gemma's vocabulary follows the same conventions (its tests' prompts), and
    <end_of_turn> ends a generation (GGUF files name it by its text alone)."""
    model = poot.load(tiny_gemma(tmp_path, "gemma3"), weights=False)
    tok = model.tokenizer
    ids = tok.encode("The fox 🙂")
    assert ids[0] == tok.bos_id == 2 and tok.token_bytes(ids[1]).startswith(b"T")
    assert tok.decode(ids, skip_special=True) == "The fox 🙂"
    assert tok.token_to_id("<end_of_turn>") in tok.eos_ids
    prompt = model.chat_template.render([{"role": "user", "content": "Hi"}],
                                        add_generation_prompt=True)
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


# -- device groups: the arithmetic of the split, in numpy (as tests/test_placement.py) --------
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_tensor_shards_and_pipeline_stages_give_the_whole_model(tmp_path, arch):
    """Post-norms read whole sums: each block's partial sums are reduced before its norm."""
    from poot.engine import placement
    from poot.ir.reference import run_group
    from tests.test_placement import interpreter, steps, whole_logits
    model = poot.load(tiny_gemma(tmp_path, arch, dtype="F32"))
    cfg = model.config
    want = whole_logits(model)
    parts = placement.tensor_parts(cfg, model.weight_shapes(), 2)
    ranks = [interpreter(model, p) for p in parts]
    for inputs, expected in zip(steps(np.random.default_rng(1), cfg.vocab_size), want):
        np.testing.assert_allclose(run_group(ranks, [inputs] * 2)[0]["logits"], expected,
                                   rtol=1e-4, atol=1e-4)
    chain = [interpreter(model, p) for p in placement.pipeline_parts(cfg, 2, 10, 3, 3)]
    for inputs, expected in zip(steps(np.random.default_rng(1), cfg.vocab_size), want):
        hidden = None
        for stage in chain:
            out = stage.run(dict(inputs, hidden=hidden) if hidden is not None else inputs)
            hidden = out.get("hidden")
        np.testing.assert_allclose(out["logits"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", VARIANTS)
def test_safetensors_folder_on_the_device_matches_transformers(tmp_path, device, arch):
    """A Hugging Face folder loaded as poot loads one (its norms uploaded as 1 + w) and run by
    the device runner: every token's logits of a prompt past the window, against
    transformers."""
    tokenizers = pytest.importorskip("tokenizers")
    model, folder = hf_model(tmp_path, arch)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={f"t{i}": i for i in range(VOCAB)},
                                                     merges=[]))
    tok.normalizer = tokenizers.normalizers.Replace(" ", "\u2581")     # as Gemma's does
    tok.decoder = tokenizers.decoders.Replace("\u2581", " ")
    tok.save(str(folder / "tokenizer.json"))
    loaded = poot.load(folder)
    assert loaded.family is gemma
    ids = np.random.default_rng().integers(0, VOCAB, 30).tolist()
    table = list(np.random.default_rng().permutation(8))
    got = loaded.runner(device, num_blocks=8, max_seqs=32).logits(step(ids, 0, table))
    want = hf_logits(model, ids)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3    # f16 KV cache


def test_rope_frequency_factors_are_refused_naming_the_file():
    from poot.errors import ModelFileError
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 2}
    with pytest.raises(ModelFileError, match="rope_freqs"):
        gemma.config_from_gguf("m.gguf", meta, {"rope_freqs.weight": None})


def test_a_chat_stops_at_end_of_turn(tmp_path):
    """A Gemma chat ends where the model writes <end_of_turn> (made certain here by a logit
    bias after four tokens' worth of min_tokens), with the marker not in the text."""
    llm = poot.LLM(tiny_gemma(tmp_path, "gemma2"), backend="reference")
    end = llm.tokenizer.token_to_id("<end_of_turn>")
    out = llm.chat([{"role": "user", "content": "Hi"}], max_tokens=20, temperature=0,
                   min_tokens=4, logit_bias={end: 100})
    assert out.finish_reason == "stop" and len(out.token_ids) <= 5
    assert "<end_of_turn>" not in out.text
    assert out.prompt_token_ids[:2] == [2, llm.tokenizer.token_to_id("<start_of_turn>")]


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_parts_on_one_device_equal_the_whole_model(tmp_path, one_device, kind, arch):
    """The device runners of a group's parts (two ranks on one Vulkan device, as
    tests/test_group.py runs them): their greedy tokens are the whole model's."""
    from poot.engine.group import GroupRunner
    model = poot.load(tiny_gemma(tmp_path, arch))
    whole = model.runner(one_device.devices[0], num_blocks=32)
    parts = GroupRunner(model, one_device, kind, 32)
    parts.allocate()
    parts.upload()
    same_greedy(whole, parts, 12)


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_over_two_gpus_equals_one(tmp_path, group, kind, arch):
    """On two CUDA devices (ptx: peer copies, all_reduce before each post-norm)."""
    from tests.test_group import runners
    whole, parts = runners(poot.load(tiny_gemma(tmp_path, arch)), group, kind, 32)
    same_greedy(whole, parts, 24)
