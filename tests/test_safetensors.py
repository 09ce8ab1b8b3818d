"""safetensors files and Hugging Face model folders: round trips in every dtype, single and sharded
folders, and a ModelFileError naming the file for every kind of broken one. The `safetensors`
package is an independent oracle where installed."""

import json
import struct

import numpy as np
import pytest

from poot.errors import ModelFileError
from poot.formats import TensorInfo, open_model
from poot.formats.safetensors import HFModelFolder, SafetensorsFile, write_safetensors

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}


def rng_and_seed():
    seed = np.random.SeedSequence().entropy
    return np.random.default_rng(seed), seed


def random_tensors(rng):
    return {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal((5,)).astype(np.float16),
        "f64": rng.standard_normal((2, 2)),
        "i8": rng.integers(-128, 128, (7,), dtype=np.int8),
        "u8": rng.integers(0, 256, (2, 3), dtype=np.uint8),
        "i32": rng.integers(-2**31, 2**31, (4,), dtype=np.int32),
        "i64": rng.integers(-2**62, 2**62, (3,), dtype=np.int64),
        "scalar": np.float32(rng.standard_normal()),
        "empty": np.zeros((0, 4), np.float32),
    }


def test_every_dtype_round_trips(tmp_path):
    rng, seed = rng_and_seed()
    tensors = random_tensors(rng)
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    with SafetensorsFile(path) as f:
        assert f.kind == "safetensors" and f.metadata == {"format": "pt"}
        assert list(f.tensors) == list(tensors)
        assert f.data_offset % 8 == 0
        for name, x in tensors.items():
            info = f.tensors[name]
            assert info == TensorInfo(name, info.dtype, np.shape(x), info.offset,
                                      np.asarray(x).nbytes, str(path))
            assert f.raw(name).tobytes() == np.asarray(x).tobytes()
            got = f.array(name)
            np.testing.assert_array_equal(got, x, err_msg=f"{name} seed {seed}")
        assert f.tensors["f16"].dtype == "F16" and f.array("f16").dtype == np.float32
        assert f.array("i64").dtype == np.int64 and f.array("f64").dtype == np.float64
        assert not f.array("f32").flags.owndata         # F32 is a view of the mapping


def test_bf16_from_bits_and_from_floats(tmp_path):
    rng, seed = rng_and_seed()
    x = rng.standard_normal((4, 8)).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)         # truncated bf16
    path = tmp_path / "bf16.safetensors"
    write_safetensors(path, {"bits": bits, "floats": x}, dtypes={"bits": "BF16", "floats": "BF16"})
    f = SafetensorsFile(path)
    assert f.tensors["bits"].dtype == "BF16" and f.tensors["bits"].nbytes == 64
    np.testing.assert_array_equal(f.array("bits"), (bits.astype(np.uint32) << 16).view(np.float32))
    rounded = f.array("floats")
    assert rounded.dtype == np.float32 and rounded.shape == (4, 8)
    assert np.all(np.abs(rounded - x) <= np.abs(x) * 2 ** -8), f"seed {seed}"
    with pytest.raises(ValueError, match="not given"):
        write_safetensors(path, {"a": x}, dtypes={"b": "BF16"})


def test_safetensors_package_agrees(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng, seed = rng_and_seed()
    tensors = {k: v for k, v in random_tensors(rng).items() if np.ndim(v)}
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors, metadata={"k": "v"})
    for name, x in st.load_file(str(ours)).items():
        np.testing.assert_array_equal(x, tensors[name], err_msg=f"seed {seed}")
    theirs = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(theirs), metadata={"k": "v"})
    f = SafetensorsFile(theirs)
    assert f.metadata == {"k": "v"}
    for name, x in tensors.items():
        np.testing.assert_array_equal(f.array(name), x, err_msg=f"seed {seed}")


def write_folder(folder, shards, extra_json=True):
    """shards: list of dicts of tensors; one shard -> model.safetensors, more -> an index."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    if extra_json:
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
        (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    if len(shards) == 1:
        write_safetensors(folder / "model.safetensors", shards[0])
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / name, shard)
        weight_map.update({t: name for t in shard})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_single_file_folder(tmp_path):
    rng, _ = rng_and_seed()
    w = rng.standard_normal((8, 16)).astype(np.float32)
    write_folder(tmp_path / "m", [{"model.embed_tokens.weight": w}])
    with open_model(tmp_path / "m") as m:
        assert isinstance(m, HFModelFolder) and m.kind == "safetensors"
        assert m.path == tmp_path / "m" and m.config == CONFIG
        assert m.tokenizer_json == {"model": {"type": "BPE"}}
        assert m.tokenizer_config == {"bos_token": "<s>"}
        assert m.generation_config == {"temperature": 0.6}
        np.testing.assert_array_equal(m.array("model.embed_tokens.weight"), w)
        assert m.raw("model.embed_tokens.weight").nbytes == w.nbytes
    with open_model(tmp_path / "m" / "model.safetensors") as m:
        assert m.config == CONFIG and list(m.tensors) == ["model.embed_tokens.weight"]


def test_sharded_folder_merges_the_shards(tmp_path):
    rng, _ = rng_and_seed()
    shards = [{f"layers.{i}.{j}": rng.standard_normal((2, 3)).astype(np.float32)
               for j in range(3)} for i in range(3)]
    write_folder(tmp_path / "m", shards, extra_json=False)
    m = HFModelFolder(tmp_path / "m")
    assert m.tokenizer_json is None and m.generation_config is None
    assert sorted(m.tensors) == sorted(n for s in shards for n in s)
    for i, shard in enumerate(shards, 1):
        for name, x in shard.items():
            assert m.tensors[name].path.endswith(f"model-{i:05d}-of-00003.safetensors")
            np.testing.assert_array_equal(m.array(name), x)
    m.close()


# --- broken files ---------------------------------------------------------------------------

def st_bytes(header, data=b"", length=None):
    head = json.dumps(header).encode() if isinstance(header, dict) else header
    return struct.pack("<Q", len(head) if length is None else length) + head + data


def refused(tmp_path, content, reason, tensor=None):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ModelFileError) as e:
        SafetensorsFile(path)
    err = e.value
    assert str(path) in str(err) and err.exit_status == 7
    assert reason in err.reason, err.reason
    assert err.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(err) and err.offset is not None
    return err


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_header_length_beyond_the_file(tmp_path):
    refused(tmp_path, st_bytes({"a": entry()}, bytes(8), length=10_000), "runs past the end")
    refused(tmp_path, b"\x01\x02", "too short")


def test_bad_json(tmp_path):
    refused(tmp_path, st_bytes(b'{"a": '), "bad JSON header")
    refused(tmp_path, st_bytes(b"[1, 2]"), "not an object")
    refused(tmp_path, st_bytes(b'{"a": 1, "a": 2}'), "duplicate key 'a'")
    refused(tmp_path, st_bytes(b"\xff\xfe"), "bad JSON header")
    refused(tmp_path, st_bytes({"__metadata__": {"k": 1}}), "__metadata__")


def test_offsets_outside_the_file(tmp_path):
    refused(tmp_path, st_bytes({"a": entry(shape=(4,), offsets=(0, 16))}, bytes(8)),
            "lies outside the file", tensor="a")


def test_offsets_not_matching_dtype_and_shape(tmp_path):
    refused(tmp_path, st_bytes({"a": entry(dtype="F16", shape=(2,), offsets=(0, 8))}, bytes(8)),
            "span 8 bytes but F16 [2] takes 4", tensor="a")
    refused(tmp_path, st_bytes({"a": entry(offsets=(8, 0))}, bytes(8)),
            "data_offsets [8, 0]", tensor="a")
    refused(tmp_path, st_bytes({"a": entry(shape=(-2,))}, bytes(8)), "shape [-2]", tensor="a")


def test_overlapping_tensors(tmp_path):
    header = {"a": entry(shape=(4,), offsets=(0, 16)), "b": entry(offsets=(8, 16))}
    refused(tmp_path, st_bytes(header, bytes(16)), "overlaps tensor 'a'", tensor="b")


def test_unsupported_dtype(tmp_path):
    refused(tmp_path, st_bytes({"a": entry(dtype="F8_E4M3", shape=(8,))}, bytes(8)),
            "unsupported dtype 'F8_E4M3'", tensor="a")


def test_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    write_safetensors(tmp_path / "m" / "model.safetensors", {"a": np.zeros(2, np.float32)})
    with pytest.raises(ModelFileError) as e:
        open_model(tmp_path / "m")
    assert str(tmp_path / "m" / "config.json") in str(e.value) and "config.json" in e.value.reason
    with pytest.raises(ModelFileError, match="config.json"):
        open_model(tmp_path / "m" / "model.safetensors")


def test_bad_config_json_and_no_weights(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{nope")
    with pytest.raises(ModelFileError, match="config.json: bad JSON"):
        HFModelFolder(folder)
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelFileError, match="no model.safetensors"):
        HFModelFolder(folder)


def test_index_naming_a_missing_shard(tmp_path):
    write_folder(tmp_path / "m", [{"a": np.zeros(2, np.float32)}, {"b": np.ones(2, np.float32)}])
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFileError) as e:
        HFModelFolder(tmp_path / "m")
    assert "model.safetensors.index.json" in e.value.path and e.value.tensor == "b"
    assert "model-00002-of-00002.safetensors" in e.value.reason


def test_index_naming_a_missing_tensor(tmp_path):
    write_folder(tmp_path / "m", [{"a": np.zeros(2, np.float32)}, {"b": np.ones(2, np.float32)}])
    index = tmp_path / "m" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ModelFileError) as e:
        HFModelFolder(tmp_path / "m")
    assert e.value.tensor == "c" and "lacks it" in e.value.reason
    index.write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(ModelFileError, match="no weight_map"):
        HFModelFolder(tmp_path / "m")


def test_missing_tensor_is_named(tmp_path):
    write_folder(tmp_path / "m", [{"a": np.zeros(2, np.float32)}])
    with pytest.raises(ModelFileError, match="'lm_head.weight'.*no such tensor"):
        HFModelFolder(tmp_path / "m").array("lm_head.weight")
