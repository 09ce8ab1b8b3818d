"""GGUF: write files with random weights and metadata of every type, read them back, and refuse
every kind of broken file with a ModelFileError naming the file, tensor and offset. The `gguf`
package (by the ggml authors) is an independent oracle where installed."""

import struct
from pathlib import Path

import numpy as np
import pytest

from poot.errors import ModelFileError
from poot.formats import TensorInfo, open_model
from poot.formats.gguf import Encoded, GGUFFile, GGUFValue, write_gguf
from poot.formats.quants import QUANTS, dequantize, quantize

REAL_MODEL = Path.home() / ".cache/poot/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def rng_and_seed():
    seed = np.random.SeedSequence().entropy
    return np.random.default_rng(seed), seed


def random_tensors(rng):
    """One 2-D tensor per dtype, plus F32 tensors of 1, 3 and 4 dimensions."""
    tensors = [(f"w.{name}", name, rng.standard_normal((3, 2 * qt.block_elems)).astype(np.float32))
               for name, qt in QUANTS.items()]
    tensors += [("norm", "F32", rng.standard_normal(7).astype(np.float32)),
                ("cube", "F32", rng.standard_normal((2, 3, 5)).astype(np.float32)),
                ("hyper", "Q8_0", rng.standard_normal((2, 1, 3, 64)).astype(np.float32))]
    return tensors


@pytest.mark.parametrize("version", [2, 3])
def test_tensors_round_trip_in_every_dtype(tmp_path, version):
    rng, seed = rng_and_seed()
    tensors = random_tensors(rng)
    path = tmp_path / "model.gguf"
    write_gguf(path, {"general.architecture": "llama"}, tensors, version=version)
    with GGUFFile(path) as f:
        assert f.kind == "gguf" and f.path == path and f.version == version
        assert list(f.tensors) == [name for name, _, _ in tensors]
        assert f.data_offset % 32 == 0
        for name, dtype, x in tensors:
            info = f.tensors[name]
            assert info == TensorInfo(name, dtype, x.shape, info.offset,
                                      QUANTS[dtype].nbytes(x.size), str(path))
            assert info.offset % 32 == 0
            raw = f.raw(name)
            assert raw.dtype == np.uint8 and not raw.flags.writeable and not raw.flags.owndata
            np.testing.assert_array_equal(raw, quantize(dtype, x), err_msg=f"{name} seed {seed}")
            expected = dequantize(dtype, quantize(dtype, x), x.shape)
            np.testing.assert_array_equal(f.array(name), expected, err_msg=f"{name} seed {seed}")
        np.testing.assert_array_equal(f.array("norm"), tensors[-3][2])
        np.testing.assert_array_equal(f.array("w.F16"), tensors[1][2].astype(np.float16))


def test_encoded_tensors_are_written_as_given(tmp_path):
    rng, _ = rng_and_seed()
    x = rng.standard_normal((4, 256)).astype(np.float32)
    raw = quantize("Q6_K", x)
    path = tmp_path / "enc.gguf"
    write_gguf(path, {}, [("w", "Q6_K", Encoded((4, 256), raw))])
    with GGUFFile(path) as f:
        np.testing.assert_array_equal(f.raw("w"), raw)
        assert f.tensors["w"].shape == (4, 256)
    with pytest.raises(ValueError, match="encoded bytes"):
        write_gguf(path, {}, [("w", "Q6_K", Encoded((4, 256), raw[:-1]))])


def test_tensors_can_be_produced_on_demand(tmp_path):
    class Ones:
        shape = (64, 128)
        produced = 0

        def __array__(self, dtype=None, copy=None):
            Ones.produced += 1
            return np.ones(self.shape, np.float32)

    path = tmp_path / "lazy.gguf"
    write_gguf(path, {}, [("w", "Q4_0", Ones())])
    assert Ones.produced == 1
    with GGUFFile(path) as f:
        np.testing.assert_array_equal(f.array("w"), 1.0)


SCALARS = {"u8": 200, "i8": -100, "u16": 60000, "i16": -30000, "u32": 4_000_000_000,
           "i32": -2_000_000_000, "f32": 0.5, "bool": True, "string": "héllo",
           "u64": 2**63 + 5, "i64": -2**62, "f64": 1e300}


def metadata_of_every_type():
    md = {f"typed.{t}": GGUFValue(t, v) for t, v in SCALARS.items()}
    md.update({f"typed.array.{t}": GGUFValue(t, [v, v]) for t, v in SCALARS.items()})
    md.update({
        "inferred.int": 30, "inferred.negative": -1, "inferred.big": 2**40,
        "inferred.float": 1e-5, "inferred.bool": False, "inferred.str": "llama",
        "inferred.strs": ["a", "b c", ""], "inferred.ints": [1, -2, 3],
        "inferred.floats": [0.5, 1, 2.25], "inferred.bools": [True, False],
        "inferred.nested": [[1, 2], [3]], "inferred.nested2": [["x"], ["y", "z"]],
        "inferred.np.f32": np.arange(5, dtype=np.float32), "inferred.np.i32": np.arange(3,
                                                                                    dtype=np.int32),
        "inferred.np.scalar": np.uint16(7),
        "typed.empty": GGUFValue("i32", []),
        "typed.nested": GGUFValue("u8", [[1], [2, 3], []]),
        "raw.bytes": GGUFValue("string", b"ab\xff\xfecd".decode("utf-8", "surrogateescape")),
    })
    return md


EXPECTED_TYPES = {  # key -> GGUF type names as the gguf package reports them
    "inferred.int": ["UINT32"], "inferred.negative": ["INT32"], "inferred.big": ["UINT64"],
    "inferred.float": ["FLOAT32"], "inferred.bool": ["BOOL"], "inferred.str": ["STRING"],
    "inferred.strs": ["ARRAY", "STRING"], "inferred.ints": ["ARRAY", "INT32"],
    "inferred.floats": ["ARRAY", "FLOAT32"], "inferred.bools": ["ARRAY", "BOOL"],
    "inferred.np.f32": ["ARRAY", "FLOAT32"], "inferred.np.i32": ["ARRAY", "INT32"],
    "inferred.np.scalar": ["UINT16"], "typed.u8": ["UINT8"], "typed.f64": ["FLOAT64"],
    "typed.array.i16": ["ARRAY", "INT16"], "typed.array.bool": ["ARRAY", "BOOL"],
}


@pytest.mark.parametrize("version", [2, 3])
def test_metadata_of_every_value_type(tmp_path, version):
    path = tmp_path / "meta.gguf"
    write_gguf(path, metadata_of_every_type(), [], version=version)
    md = GGUFFile(path).metadata
    for t, v in SCALARS.items():
        got = md[f"typed.{t}"]
        assert got == v and type(got) is type(v), t
        arr = md[f"typed.array.{t}"]
        if t == "string":
            assert arr == [v, v]
        else:
            assert isinstance(arr, np.ndarray) and arr.tolist() == [v, v], t
    assert md["typed.array.u64"].dtype == np.uint64 and md["typed.array.bool"].dtype == bool
    assert md["inferred.int"] == 30 and md["inferred.negative"] == -1
    assert md["inferred.big"] == 2**40 and md["inferred.bool"] is False
    assert md["inferred.float"] == np.float32(1e-5) and md["inferred.str"] == "llama"
    assert md["inferred.strs"] == ["a", "b c", ""]
    assert md["inferred.ints"].tolist() == [1, -2, 3] and md["inferred.ints"].dtype == np.int32
    assert md["inferred.floats"].tolist() == [0.5, 1.0, 2.25]
    assert md["inferred.bools"].tolist() == [True, False]
    assert [a.tolist() for a in md["inferred.nested"]] == [[1, 2], [3]]
    assert md["inferred.nested2"] == [["x"], ["y", "z"]]
    assert md["inferred.np.f32"].tolist() == [0, 1, 2, 3, 4]
    assert md["inferred.np.scalar"] == 7
    assert md["typed.empty"].dtype == np.int32 and md["typed.empty"].size == 0
    assert [a.tolist() for a in md["typed.nested"]] == [[1], [2, 3], []]
    # Bytes that are not UTF-8 survive the round trip exactly.
    assert md["raw.bytes"].encode("utf-8", "surrogateescape") == b"ab\xff\xfecd"


def test_gguf_package_reads_our_metadata_types_and_tensors(tmp_path):
    gguf = pytest.importorskip("gguf")
    rng, seed = rng_and_seed()
    tensors = random_tensors(rng)
    path = tmp_path / "oracle.gguf"
    metadata = {k: v for k, v in metadata_of_every_type().items()
                if not k.startswith(("inferred.nested", "typed.nested", "raw."))}
    write_gguf(path, metadata, tensors)
    reader = gguf.GGUFReader(path)
    for key, types in EXPECTED_TYPES.items():
        assert [t.name for t in reader.fields[key].types] == types, key
    assert reader.fields["typed.string"].contents() == "héllo"
    assert reader.fields["inferred.strs"].contents() == ["a", "b c", ""]
    ours = GGUFFile(path)
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert t.tensor_type.name == info.dtype
        assert tuple(int(n) for n in reversed(t.shape)) == info.shape
        assert t.data_offset == info.offset
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(info.shape)
        np.testing.assert_array_equal(ours.array(t.name), theirs, err_msg=f"seed {seed}")


def test_we_read_a_file_written_by_the_gguf_package(tmp_path):
    gguf = pytest.importorskip("gguf")
    rng, seed = rng_and_seed()
    path = tmp_path / "theirs.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.5])
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    assert f.metadata["general.architecture"] == "llama"
    assert f.metadata["llama.block_count"] == 2
    assert f.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "b"]
    assert f.metadata["tokenizer.ggml.scores"].tolist() == [0.0, -1.5, -2.5]
    np.testing.assert_array_equal(f.array("f32"), x)
    np.testing.assert_array_equal(f.array("f16"), x.astype(np.float16))
    assert f.tensors["q8"].shape == (8, 64)
    np.testing.assert_array_equal(f.array("q8"), gguf.quants.dequantize(
        q, gguf.GGMLQuantizationType.Q8_0), err_msg=f"seed {seed}")


@pytest.mark.parametrize("alignment", [64, 8])
def test_non_default_alignment(tmp_path, alignment):
    rng, _ = rng_and_seed()
    tensors = random_tensors(rng)
    path = tmp_path / "aligned.gguf"
    write_gguf(path, {"general.name": "x"}, tensors, alignment=alignment)
    f = GGUFFile(path)
    assert f.alignment == alignment and f.metadata["general.alignment"] == alignment
    assert f.data_offset % alignment == 0
    assert all(t.offset % alignment == 0 for t in f.tensors.values())
    np.testing.assert_array_equal(f.array("cube"), tensors[-2][2])
    with pytest.raises(ValueError, match="disagrees"):
        write_gguf(path, {"general.alignment": 32}, [], alignment=64)


def test_arrays_outlive_the_closed_file(tmp_path):
    path = tmp_path / "m.gguf"
    x = np.arange(64, dtype=np.float32)
    write_gguf(path, {}, [("x", "F32", x)])
    with GGUFFile(path) as f:
        view = f.array("x")
    np.testing.assert_array_equal(view, x)


def test_write_refuses_what_gguf_cannot_hold(tmp_path):
    p = tmp_path / "x.gguf"
    with pytest.raises(ValueError, match="empty list"):
        write_gguf(p, {"k": []}, [])
    with pytest.raises(ValueError, match="one GGUF type"):
        write_gguf(p, {"k": [1, "a"]}, [])
    with pytest.raises(ValueError, match="300 does not fit in a GGUF u8"):
        write_gguf(p, {"k": GGUFValue("u8", 300)}, [])
    with pytest.raises(ValueError, match="do not fit in a GGUF i8 array"):
        write_gguf(p, {"k": GGUFValue("i8", [1, 200])}, [])
    with pytest.raises(ValueError, match="unknown GGUF value type 'u128'"):
        write_gguf(p, {"k": GGUFValue("u128", 1)}, [])
    with pytest.raises(ValueError, match="cannot store a dict"):
        write_gguf(p, {"k": {}}, [])
    with pytest.raises(ValueError, match="duplicate tensor"):
        write_gguf(p, {}, [("a", "F32", np.zeros(2)), ("a", "F32", np.zeros(2))])
    with pytest.raises(ValueError, match="5 dimensions"):
        write_gguf(p, {}, [("a", "F32", np.zeros((1, 1, 1, 1, 2)))])
    with pytest.raises(ValueError, match="row length 40"):
        write_gguf(p, {}, [("a", "Q8_0", np.zeros((2, 40)))])
    with pytest.raises(ValueError, match="unsupported dtype 'IQ2_XXS'"):
        write_gguf(p, {}, [("a", "IQ2_XXS", np.zeros(256))])
    with pytest.raises(ValueError, match="version 2 or 3"):
        write_gguf(p, {}, [], version=1)


# --- broken files, built byte by byte -----------------------------------------------------------

def s(text):
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_bytes(kvs=(), infos=(), data=b"", version=3, n_tensors=None, n_kv=None, align=32):
    """kvs: (key, value type, payload bytes); infos: (name, ne fastest first, ggml type,
    relative offset)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv)
    for key, vtype, payload in kvs:
        out += s(key) + struct.pack("<I", vtype) + payload
    for name, ne, ttype, offset in infos:
        out += s(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ttype, offset)
    return out + bytes(-len(out) % align) + data


def refused(tmp_path, content, reason, tensor=None, offset=True):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path)
    err = e.value
    assert str(path) in str(err) and err.path == str(path)
    assert err.exit_status == 7
    assert reason in err.reason, err.reason
    assert err.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(err)
    if offset:
        assert err.offset is not None and f"offset {err.offset}" in str(err)
    return err


F32_8 = ("t", [8], 0, 0)                # an F32 tensor of 8 values (32 bytes) at offset 0


def test_a_valid_hand_built_file_opens(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes([("k", 4, struct.pack("<I", 7))], [F32_8],
                                np.arange(8, dtype="<f4").tobytes()))
    f = GGUFFile(path)
    assert f.metadata == {"k": 7}
    np.testing.assert_array_equal(f.array("t"), np.arange(8))


def test_bad_magic(tmp_path):
    err = refused(tmp_path, b"GGML" + gguf_bytes()[4:], "bad magic")
    assert err.offset == 0


def test_version_1_is_refused(tmp_path):
    refused(tmp_path, gguf_bytes(version=1), "unsupported GGUF version 1")


def test_unknown_version_and_big_endian(tmp_path):
    refused(tmp_path, gguf_bytes(version=4), "unsupported GGUF version 4")
    refused(tmp_path, gguf_bytes(version=3 << 24), "big-endian")


def test_empty_and_truncated_header(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty file"):
        GGUFFile(path)
    refused(tmp_path, gguf_bytes()[:13], "truncated")


def test_string_running_past_the_end(tmp_path):
    content = gguf_bytes([("name", 8, struct.pack("<Q", 1000) + b"abc")])
    refused(tmp_path, content, "truncated: metadata 'name' (a string of 1000 bytes)")
    key_too_long = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40) + b"k" * 20
    refused(tmp_path, key_too_long, "truncated: metadata key")


def test_absurd_counts(tmp_path):
    refused(tmp_path, gguf_bytes(n_tensors=2**40), "tensor count 1099511627776 cannot fit")
    refused(tmp_path, gguf_bytes(n_kv=2**62), "metadata key-value count")
    huge_array = struct.pack("<IQ", 4, 2**60)
    refused(tmp_path, gguf_bytes([("a", 9, huge_array)]), "element count 1152921504606846976")


def test_bad_metadata_values(tmp_path):
    refused(tmp_path, gguf_bytes([("k", 13, b"\0" * 8)]), "unknown value type 13")
    refused(tmp_path, gguf_bytes([("k", 7, b"\x02")]), "bool byte is 2")
    refused(tmp_path, gguf_bytes([("k", 4, b"\0" * 4), ("k", 4, b"\0" * 4)]),
            "duplicate metadata key 'k'")
    nested = struct.pack("<IQ", 9, 1) * 9 + struct.pack("<IQ", 0, 0)
    refused(tmp_path, gguf_bytes([("k", 9, nested)]), "nested deeper")
    refused(tmp_path, gguf_bytes([("general.alignment", 4, struct.pack("<I", 24))]),
            "general.alignment 24 is not a positive power of two")


def test_unknown_ggml_type(tmp_path):
    refused(tmp_path, gguf_bytes(infos=[("t", [8], 99, 0)], data=bytes(32)),
            "unknown ggml type 99", tensor="t")


def test_unsupported_ggml_type_is_named(tmp_path):
    refused(tmp_path, gguf_bytes(infos=[("t", [256], 16, 0)], data=bytes(66)),
            "unsupported dtype IQ2_XXS", tensor="t")


def test_unaligned_tensor_offset(tmp_path):
    refused(tmp_path, gguf_bytes(infos=[("t", [8], 0, 16)], data=bytes(64)),
            "data offset 16 (relative to the data section at", tensor="t")


def test_tensor_data_outside_the_file(tmp_path):
    err = refused(tmp_path, gguf_bytes(infos=[F32_8], data=bytes(31)),
                  "lies outside the file", tensor="t")
    assert err.offset % 32 == 0
    refused(tmp_path, gguf_bytes(infos=[("t", [8], 0, 2**40)], data=bytes(32)),
            "lies outside the file", tensor="t")


def test_overlapping_tensors(tmp_path):
    infos = [("a", [16], 0, 0), ("b", [8], 0, 32)]       # a covers [0, 64), b starts at 32
    refused(tmp_path, gguf_bytes(infos=infos, data=bytes(64)),
            "overlaps tensor 'a', which ends at", tensor="b")


def test_duplicate_tensor_names(tmp_path):
    infos = [("a", [8], 0, 0), ("a", [8], 0, 32)]
    refused(tmp_path, gguf_bytes(infos=infos, data=bytes(64)), "duplicate tensor name",
            tensor="a")


def test_more_than_four_dimensions(tmp_path):
    refused(tmp_path, gguf_bytes(infos=[("t", [1, 1, 1, 1, 8], 0, 0)], data=bytes(32)),
            "5 dimensions, at most 4", tensor="t")


def test_row_length_not_a_multiple_of_the_block(tmp_path):
    refused(tmp_path, gguf_bytes(infos=[("t", [48], 2, 0)], data=bytes(64)),
            "row length 48 is not a multiple of the Q4_0 block size 32", tensor="t")
    refused(tmp_path, gguf_bytes(infos=[("t", [], 8, 0)], data=bytes(64)),
            "row length 1 is not a multiple of the Q8_0 block size 32", tensor="t")


def test_truncated_tensor_info(tmp_path):
    header = gguf_bytes(infos=[F32_8], align=1)         # 24 bytes of header + 33 of info
    assert len(header) == 24 + 33
    refused(tmp_path, header[:-1], "truncated: tensor data offset needs 8 bytes", tensor="t")


def test_damaged_files_fail_only_with_model_file_errors(tmp_path):
    rng, seed = rng_and_seed()
    good = tmp_path / "good.gguf"
    write_gguf(good, {"a": [1, 2], "b": "text", "c": [["x"]], "d": 1.5},
               [("w", "Q4_K", rng.standard_normal((2, 256))), ("n", "F32", np.ones(8))])
    content = good.read_bytes()
    head = GGUFFile(good).data_offset
    path = tmp_path / "damaged.gguf"
    damaged = [content[:n] for n in range(1, head + 8)]
    for _ in range(300):
        b = bytearray(content)
        for at in rng.integers(0, head, rng.integers(1, 4)):
            b[at] = rng.integers(0, 256)
        damaged.append(bytes(b))
    for content in damaged:
        path.write_bytes(content)
        try:
            f = GGUFFile(path)
        except ModelFileError as e:
            assert str(path) in str(e)
            continue
        for name in f.tensors:
            assert f.array(name).shape == f.tensors[name].shape, f"seed {seed}"


def test_missing_tensor_and_missing_file(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, {}, [("x", "F32", np.zeros(4))])
    with pytest.raises(ModelFileError, match="'nope'.*no such tensor"):
        GGUFFile(path).array("nope")
    with pytest.raises(ModelFileError, match="cannot open"):
        GGUFFile(tmp_path / "absent.gguf")


def test_open_model_picks_the_reader(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, {}, [("x", "F32", np.zeros(4))])
    with open_model(path) as m:
        assert m.kind == "gguf" and list(m.tensors) == ["x"]
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(path.read_bytes())
    assert open_model(renamed).kind == "gguf"
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ModelFileError, match="expected a .gguf file"):
        open_model(other)
    with pytest.raises(ModelFileError, match="no such file"):
        open_model(tmp_path / "missing.gguf")


# --- the real default model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_model():
    if not REAL_MODEL.exists():
        pytest.skip(f"{REAL_MODEL} is not downloaded")
    with GGUFFile(REAL_MODEL) as f:
        yield f


def test_real_model_layout(real_model):
    f = real_model
    assert len(f.tensors) == 272
    assert {t.dtype for t in f.tensors.values()} == {"Q4_1", "Q8_0", "F32"}
    assert f.metadata["general.architecture"] == "llama"
    assert f.metadata["llama.block_count"] == 30
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert f.metadata["tokenizer.ggml.token_type"].dtype == np.int32
    emb = f.tensors["token_embd.weight"]
    assert emb.dtype == "Q8_0" and emb.shape == (49152, 576)
    assert f.tensors["blk.0.attn_q.weight"].shape == (576, 576)
    assert f.tensors["blk.0.attn_k.weight"].shape == (192, 576)


def test_real_model_values_are_sane(real_model):
    emb = real_model.array("token_embd.weight")
    assert np.all(np.isfinite(emb))
    assert 0.02 < float(emb.std()) < 1.0
    assert 0.01 < float(np.linalg.norm(emb[1000:2000], axis=1).mean() / np.sqrt(576)) < 1.0
    norm = real_model.array("blk.0.attn_norm.weight")
    assert norm.shape == (576,) and np.all(np.isfinite(norm))


def test_real_model_matches_the_gguf_package(real_model):
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(REAL_MODEL)
    by_name = {t.name: t for t in reader.tensors}
    for name in ["blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"]:
        t = by_name[name]
        assert t.data_offset == real_model.tensors[name].offset
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            real_model.tensors[name].shape)
        np.testing.assert_array_equal(real_model.array(name), theirs, err_msg=name)
    rows = slice(0, 512)   # a slice of the embedding keeps this fast
    emb = by_name["token_embd.weight"]
    np.testing.assert_array_equal(
        real_model.array("token_embd.weight")[rows],
        gguf.quants.dequantize(emb.data[rows], emb.tensor_type))
    assert reader.fields["tokenizer.ggml.tokens"].contents(slice(0, 300)) == \
        real_model.metadata["tokenizer.ggml.tokens"][:300]
