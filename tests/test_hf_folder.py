"""A Hugging Face model folder end to end: safetensors weights, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json — written here with
transformers and tokenizers (test-only), generated from with poot, compared with transformers'
own greedy generation."""
import json

import numpy as np
import pytest

import poot
from poot.models.random_weights import CHATML, byte_level_vocab

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def write_folder(folder, arch):
    vocab, merges = byte_level_vocab(320)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHATML}))
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    config = cls[0](vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    bos_token_id=0, eos_token_id=2, tie_word_embeddings=False)
    model = cls[1](config).eval()
    with torch.no_grad():            # sharper logits than the default init, so greedy is stable
        for p in model.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_folder_generates_what_transformers_generates(tmp_path, arch):
    folder = tmp_path / arch
    model = write_folder(folder, arch)
    llm = poot.LLM(folder, backend="reference")
    prompt = "The quick brown fox"
    ids = llm.prompt_ids(prompt)
    assert ids == tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(
        prompt).ids
    ours = llm.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours.token_ids == theirs
    chat = llm.chat_prompt_ids([{"role": "user", "content": "Hi"}])
    assert chat[:2] == [1, llm.tokenizer.encode("user", add_special=False)[0]]
