"""A model over two CUDA devices (engine/group.py on backends/ptx.PtxGroup) against the same
model on one: prefill, decode replays, batched decode and a pipeline's lanes under the engine
give the one-device logits and greedy tokens, for both placements. Needs two CUDA devices with
peer access; skips with the reason elsewhere.

Where there is one device (lavapipe in CI), OneDeviceGroup puts both ranks (or three) on it: the
runners of each part, their lockstep, the reduction kernel reading the other rank's partial
sums, the gathering of the ranks' slices of the logits and the stage-to-stage copies run for
real, eagerly and in issue order on one queue; what only two CUDA devices show (events across
devices, peer memory, one CUDA graph over both) is the tests above."""
import numpy as np
import pytest

import poot
from poot.backends import DeviceGroup
from poot.backends.ptx import PtxGroup
from poot.engine.batch import SamplingRows, StepBatch
from poot.engine.group import GroupRunner
from poot.errors import BackendUnavailable, NoSuchDevice, PlacementRefused
from tests.conftest import open_or_skip
from tests.models import default_model, tiny_model
from tests.test_device_runner import greedy


@pytest.fixture(scope="module")
def group():
    try:
        return PtxGroup([0, 1])
    except (BackendUnavailable, NoSuchDevice) as e:
        pytest.skip(f"two CUDA devices are needed: {e}")


def runners(model, group, kind, num_blocks, **shape):
    one = model.runner(group.devices[0], num_blocks=num_blocks, **shape)
    two = GroupRunner(model, group, kind, num_blocks, **shape)
    two.allocate()
    two.upload()
    return one, two


def same_greedy(one, two, n):
    """A prompt, then n greedy steps on shuffled KV blocks: the same tokens and logits."""
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(one, [5, 80, 9, 41], n, table)
    got_ids, got = greedy(two, [5, 80, 9, 41], n, table)
    assert got_ids == want_ids
    # a shard's matmul may take another kernel than the whole one (mma_vec rounds its x to f16
    # where a shard's columns allow it, the whole matrix's may not, or the reverse)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


CASES = [("tiny", "F16", "llama"), ("tiny-odd", "Q4_0", "llama"), ("tiny-odd", "F16", "llama"),
         ("tiny", "F32", "qwen2"), ("tiny", "BF16", "qwen3"), ("tiny-k", "Q6_K", "llama"),
         ("tiny-odd", "Q4_0", "llama", "tied")]     # the embedding table as the output head


def load(tmp_path, case):
    shape, dtype, arch, *tied = case
    return poot.load(tiny_model(tmp_path, dtype=dtype, arch=arch, shape=shape, tied=bool(tied)))


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_group_greedy_equals_one_device(tmp_path, group, kind, case):
    model = load(tmp_path, case)
    if kind == "tensor" and case[0] == "tiny-k":
        # 256-column blocks, heads of 64 columns: the split would cut a block (refused)
        with pytest.raises(PlacementRefused, match="inside a block"):
            GroupRunner(model, group, kind, 32)
        return
    one, two = runners(model, group, kind, 32)
    same_greedy(one, two, 24)


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_group_batched_decode_equals_one_device(tmp_path, group, kind):
    """128 sequences decoding together: one graph over both devices."""
    model = poot.load(tiny_model(tmp_path, dtype="F16", shape="tiny-odd"))
    n, per_seq = 128, 4
    one, two = runners(model, group, kind, n * per_seq, max_tokens=n, max_seqs=n)
    rng = np.random.default_rng()
    tables = rng.permutation(n * per_seq).astype(np.int32).reshape(n, per_seq)
    for runner in (one, two):                       # the same 5-token prompt in every row
        for s in range(n):
            runner.logits(StepBatch(np.array([5, 80, 9, 41, 7], np.int32),
                                    np.arange(5, dtype=np.int32), np.zeros(5, np.int32),
                                    tables[s:s + 1], np.array([4], np.int32),
                                    SamplingRows.greedy(1)))
    tokens = rng.integers(0, model.config.vocab_size, n).astype(np.int32)
    for position in range(5, 13):
        batch = StepBatch(tokens, np.full(n, position, np.int32), np.arange(n, dtype=np.int32),
                          tables, np.arange(n, dtype=np.int32), SamplingRows.greedy(n))
        got = two.logits(batch)
        want = one.logits(batch)
        # 128 tokens run on the tensor cores with f16 operands: the group adds its partial sums
        # in another order, which moves some activations across an f16 rounding boundary
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
        tokens = np.argmax(want, axis=1).astype(np.int32)
        # the greedy choices agree wherever the best logit leads by more than that rounding
        # can move it (seen on two H200s: a near tie of a random model flipped)
        top = np.sort(want, axis=1)
        clear = top[:, -1] - top[:, -2] > 2e-3 * np.abs(want).max()
        assert clear.mean() > 0.9
        got_tokens, want_tokens = two.step(batch).tokens, one.step(batch).tokens
        assert np.array_equal(got_tokens[clear], want_tokens[clear])
        assert np.array_equal(want_tokens, tokens)
    assert two.graphs, "decode steps were not replayed from a captured graph"


def test_two_phase_reduction_equals_one_device(tmp_path, group):
    """The reduce-scatter + all-gather form (used from three devices on, for long messages),
    forced on two devices for every message: prefill and decode as on one device."""
    model = poot.load(tiny_model(tmp_path, dtype="Q4_0", shape="tiny-odd"))
    one, two = runners(model, group, "tensor", 32)
    for runner in two.runners:
        runner.two_phase_floats = 0
    same_greedy(one, two, 16)


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_default_model_over_two_devices(group, kind):
    model = poot.load(default_model())
    one, two = runners(model, group, kind, 64)
    prompt = model.tokenizer.encode("The capital of France is")
    table = list(range(64))
    want_ids, _ = greedy(one, prompt, 32, table)
    got_ids, _ = greedy(two, prompt, 32, table)
    assert got_ids == want_ids


def test_serve_refuses_an_ordinal_the_driver_does_not_list(group, capsys):
    from poot.serve.cli import main
    assert main(["--backend", "ptx", "--placement", "tensor:0,9", "--model", "unused"]) == 2
    err = capsys.readouterr().err
    assert "--placement tensor:0,9" in err and "no CUDA device 9" in err


def test_poot_serve_gives_the_same_tokens_under_every_placement(tmp_path, group):
    """scripts/compare-placements: poot-serve under one device, pipeline and tensor; /health
    shows each device's part, footprint and post-allocation check."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    model = tiny_model(tmp_path, dtype="Q4_0", shape="tiny-odd")
    script = Path(__file__).resolve().parent.parent / "scripts" / "compare-placements"
    result = subprocess.run([sys.executable, str(script), "--model", str(model), "--tokens", "24",
                             "--ctx", "512", "0", "pipeline:0,1", "tensor:0,1"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("same tokens as 0") == 2
    health = [json.loads(line.split("/health: ", 1)[1]) for line in result.stdout.splitlines()
              if "/health: " in line]
    assert [len(h["plan"].get("devices", [None])) for h in health] == [1, 2, 2]
    assert [h["plan"].get("lanes") for h in health] == [None, 2, 1]
    for h in health[1:]:
        assert [d["part"]["logits"] for d in h["plan"]["devices"]] in ([False, True],
                                                                        [True, False])
        assert all(d["checked"]["measured"] > 0 for d in h["plan"]["devices"])
    # tensor: each device computes the logits of its half of the 320 rows of the output head
    assert [d["part"]["vocab_rows"] for d in health[2]["plan"]["devices"]] == [[0, 160],
                                                                               [160, 320]]


def test_compare_placements_on_one_device_of_the_reference(tmp_path):
    """The script end to end where CI can run it: the same placement twice on the reference
    backend agrees with itself, token ids and logprobs included."""
    import socket
    import subprocess
    import sys
    from pathlib import Path
    model = tiny_model(tmp_path)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    script = Path(__file__).resolve().parent.parent / "scripts" / "compare-placements"
    result = subprocess.run([sys.executable, str(script), "--backend", "reference", "--model",
                             str(model), "--tokens", "6", "--ctx", "256", "--logprobs", "2",
                             "--port", str(port), "0", "0"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("-> 6 tokens") == 6 and "0: same tokens as 0\n" in result.stdout


class OneDeviceGroup(DeviceGroup):
    """Two ranks (or more) on one device, in place of two GPUs (see the module's docstring). A
    device's launches run in issue order, so barriers and events have nothing to order."""

    def __init__(self, device, ranks=2):
        self.devices = [device] * ranks
        self.name = device.name

    def barrier(self):
        pass

    def signal(self, i):
        pass

    def wait(self, i, j):
        pass

    def copy(self, i, dst, j, src, nbytes):
        self.devices[i].copy(dst, src, nbytes)


@pytest.fixture(scope="module")
def one_device():
    return OneDeviceGroup(open_or_skip("vulkan"))


ONE_DEVICE_CASES = CASES[:4] + CASES[-1:]


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
@pytest.mark.parametrize("case", ONE_DEVICE_CASES, ids=["-".join(c) for c in ONE_DEVICE_CASES])
def test_parts_on_one_device_equal_the_whole_model(tmp_path, one_device, kind, case):
    model = load(tmp_path, case)
    one = model.runner(one_device.devices[0], num_blocks=32)
    two = GroupRunner(model, one_device, kind, 32)
    two.allocate()
    two.upload()
    assert [r.part for r in two.runners] == two.parts and len(two.runners) == 2
    same_greedy(one, two, 12)


HEAD_CASES = [(2, CASES[0]), (3, CASES[1]), (2, CASES[-1])]


@pytest.mark.parametrize("ranks,case", HEAD_CASES,
                         ids=[f"{n}-" + "-".join(c) for n, c in HEAD_CASES])
def test_tensor_ranks_on_one_device_split_the_output_head(tmp_path, one_device, ranks, case):
    """Each rank holds its rows of the output head (320 rows: 107, 107, 106 over three ranks)
    and computes their logits; rank 0 gathers them from the others' buffers, reads them back
    and takes the argmax on the device. A tied head stays whole on rank 0."""
    model = load(tmp_path, case)
    cfg = model.config
    one = model.runner(one_device.devices[0], num_blocks=32)
    two = GroupRunner(model, OneDeviceGroup(one_device.devices[0], ranks), "tensor", 32)
    two.allocate()
    two.upload()
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"

    def nbytes(runner, name):
        return sum(a.nbytes for a in runner.allocations() if a.name.split(":")[0] == name)

    whole = nbytes(one, head)
    if cfg.tied_embeddings:
        assert [nbytes(r, head) for r in two.runners] == [whole] * ranks
    else:
        rows = [r.part.vocab[1] - r.part.vocab[0] for r in two.runners]
        assert sum(rows) == cfg.vocab_size and max(rows) - min(rows) <= 1
        assert [nbytes(r, head) for r in two.runners] == [whole * n // cfg.vocab_size
                                                          for n in rows]
        assert [nbytes(r, "gather.0") for r in two.runners] == [r.max_seqs * n * 4 for r, n
                                                                in zip(two.runners, rows)]
    assert [r.has_logits for r in two.runners] == [True] + [False] * (ranks - 1)
    assert nbytes(two.head, two.head._output_name()) == two.max_seqs * cfg.vocab_size * 4
    same_greedy(one, two, 12)
    rng = np.random.default_rng()
    tables = rng.permutation(32).astype(np.int32).reshape(4, 8)
    for runner in (one, two):                       # a prompt in each of four rows
        for s in range(4):
            runner.logits(StepBatch(np.array([5, 80, 9], np.int32), np.arange(3, dtype=np.int32),
                                    np.zeros(3, np.int32), tables[s:s + 1],
                                    np.array([2], np.int32), SamplingRows.greedy(1)))
    batch = StepBatch(rng.integers(0, cfg.vocab_size, 4).astype(np.int32),
                      np.full(4, 3, np.int32), np.arange(4, dtype=np.int32), tables,
                      np.arange(4, dtype=np.int32), SamplingRows.greedy(4))
    assert np.array_equal(two.step(batch).tokens, one.step(batch).tokens)


def test_tensor_ranks_share_kv_heads_in_long_steps(tmp_path, one_device, monkeypatch):
    """A long step's attention workgroups take several query heads of one KV head on each rank
    (forced: the tiny model's steps are too short to by themselves), as on one device."""
    from poot.engine import kernel_choice
    from poot.kernels import ops
    from tests.test_device_runner import prefill_of
    monkeypatch.setattr(kernel_choice, "SHARED_HEADS_PER_SM", 0)
    model = load(tmp_path, CASES[0])
    cfg = model.config
    if ops.attention_heads(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           one_device.devices[0].subgroup_size) == 1:
        pytest.skip("the tiny model's KV heads each serve one query head")
    batch = prefill_of(40)
    want = model.runner(None, num_blocks=16).logits(batch)
    two = GroupRunner(model, one_device, "tensor", 16, max_tokens=64)
    two.allocate()
    two.upload()
    assert all(r.choice.attention_heads(40, cfg.n_heads // 2, cfg.n_kv_heads // 2) > 1
               for r in two.runners)
    got = two.logits(batch)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


EDITED = [dict(max_tokens=10, temperature=0, repetition_penalty=1.8, frequency_penalty=0.5,
               presence_penalty=0.4, ignore_eos=True),
          dict(max_tokens=10, temperature=0, logit_bias={2: 50.0}, min_tokens=4),
          dict(max_tokens=8, temperature=0.9, seed=7, top_k=40, frequency_penalty=-1.5,
               logit_bias={17: 4.0, 18: -100.0}, ignore_eos=True),
          dict(max_tokens=8, temperature=0, ignore_eos=True)]


def edited_tokens(runner, model):
    """The tokens of four requests with penalties, logit biases (a ban) and min_tokens, run
    together by an Engine over `runner`."""
    from poot.engine.request import SamplingParams
    from poot.engine.engine import Engine
    rng = np.random.default_rng(8)
    engine = Engine(runner, model.tokenizer, max_seqs=4, step_tokens=32)
    handles = [engine.submit(rng.integers(3, 300, n).tolist(), SamplingParams(**params))
               for n, params in zip((9, 30, 5, 14), EDITED)]
    engine.run_until_idle()
    return [[t for out in h for t in out.token_ids] for h in handles]


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_edits_over_two_devices_give_the_one_devices_tokens(tmp_path, group, kind):
    """Penalties, logit biases and min_tokens over two CUDA devices (decode steps replayed from
    graphs that launch the edits on the device that holds the logits), as on one."""
    model = load(tmp_path, CASES[0])
    one, two = runners(model, group, kind, 64, max_tokens=32, max_seqs=4)
    assert edited_tokens(two, model) == edited_tokens(one, model)
    assert any(key.edited for lane in two.lanes for key in lane.graphs), "no graph edits"


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_a_groups_logits_are_edited_on_the_device_that_holds_them(tmp_path, one_device, kind):
    """Penalties, logit biases and min_tokens over a group (a pipeline's lanes too): only the
    runner that holds the logits (a tensor group's rank 0, a pipeline's last stage) has edit
    buffers and applies the edits, and the tokens are the one device's."""
    model = load(tmp_path, CASES[0])
    two = GroupRunner(model, one_device, kind, 64, max_tokens=32, max_seqs=4)
    two.allocate()
    two.upload()
    assert [any(a.name.startswith("edit_") for a in r.allocations()) for r in two.runners] \
        == [r.has_logits for r in two.runners] == [kind == "tensor", kind == "pipeline"]
    one = model.runner(one_device.devices[0], num_blocks=64, max_tokens=32, max_seqs=4)
    assert edited_tokens(two, model) == edited_tokens(one, model)


def engine_tokens(runner, model, requests, **kw):
    """The greedy tokens of each (prompt, max_tokens) request, run together by an Engine over
    `runner`."""
    from poot.engine.request import SamplingParams
    from poot.engine.engine import Engine
    engine = Engine(runner, model.tokenizer, **kw)
    handles = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
               for p, n in requests]
    engine.run_until_idle()
    assert engine.idle and engine.kv.num_used == 0
    return [[t for out in h for t in out.token_ids] for h in handles], engine


def lane_requests(model, lengths, tokens):
    rng = np.random.default_rng(7)
    return [(rng.integers(3, model.config.vocab_size, int(n)).tolist(), int(t))
            for n, t in zip(lengths, tokens)]


def counting_launches(runner, monkeypatch):
    """Counts the steps each of a group runner's lanes launches (their own launch, counted)."""
    counts = [0] * len(runner.lanes)
    for i, lane in enumerate(runner.lanes):
        def launch(batch, i=i, real=lane.launch):
            counts[i] += 1
            return real(batch)
        monkeypatch.setattr(lane, "launch", launch)
    return counts


LANE_CASES = {"plenty": (64, [14, 3, 9, 14, 29, 1, 14, 12], [22, 30, 25, 4, 19, 33, 9, 24]),
              # eight sequences growing to 3 blocks each in 14: preempted in their lane
              "short": (14, [14, 13, 15, 14, 12, 15, 14, 13], [30, 31, 29, 33, 30, 28, 34, 30]),
              # one sequence a lane, 3 blocks each in 4: the first, out of blocks, can only
              # preempt the other lane's, whose step is in flight: it collects that step first
              "drain": (4, [14, 14], [30, 30])}


def same_tokens_through_lanes(tmp_path, group, monkeypatch, case):
    """An Engine over a pipeline with two lanes: each lane's step in flight while the other's
    is scheduled, the sequences shared between the lanes, the tokens those of one device."""
    num_blocks, lengths, max_tokens = LANE_CASES[case]
    model = load(tmp_path, CASES[0])
    requests = lane_requests(model, lengths, max_tokens)
    shape = dict(max_tokens=64, max_seqs=8)
    want, _ = engine_tokens(model.runner(group.devices[0], num_blocks=64, **shape), model,
                            requests, max_seqs=8, step_tokens=64)
    two = GroupRunner(model, group, "pipeline", num_blocks, **shape)
    assert len(two.lanes) == 2
    two.allocate()
    two.upload()
    launches = counting_launches(two, monkeypatch)
    got, engine = engine_tokens(two, model, requests, max_seqs=8, step_tokens=64)
    assert got == want
    assert min(launches) > 5, launches
    assert (engine.stats().preemptions_total > 0) == (case != "plenty")
    return two


@pytest.mark.parametrize("case", LANE_CASES)
def test_pipeline_lanes_through_the_engine_equal_one_device(tmp_path, one_device, monkeypatch,
                                                           case):
    same_tokens_through_lanes(tmp_path, one_device, monkeypatch, case)


@pytest.mark.parametrize("case", LANE_CASES)
def test_pipeline_lanes_on_two_devices_through_the_engine(tmp_path, group, monkeypatch, case):
    """As above on two CUDA devices: the lanes' steps, replayed graphs on streams of their own,
    run at once on the same weights and KV cache."""
    two = same_tokens_through_lanes(tmp_path, group, monkeypatch, case)
    assert all(lane.graphs for lane in two.lanes)
    assert two.lanes[1].runners[0].device.stream != two.runners[0].device.stream


def test_a_request_cancelled_while_its_lane_runs_frees_its_blocks_after(tmp_path, one_device):
    """Cancelling a sequence whose lane's step is in flight collects that step first (its
    kernels still write the sequence's KV blocks), then frees the blocks; the other sequences
    go on with the tokens they would have had."""
    from poot.engine.request import SamplingParams
    from poot.engine.engine import Engine
    model = load(tmp_path, CASES[0])
    requests = lane_requests(model, [9, 12, 7, 10], [20, 20, 20, 20])
    want, _ = engine_tokens(model.runner(one_device.devices[0], num_blocks=32), model, requests)
    two = GroupRunner(model, one_device, "pipeline", 32)
    two.allocate()
    two.upload()
    engine = Engine(two, model.tokenizer)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    handles = [engine.submit(p, params) for p, _ in requests]
    for _ in range(6):
        engine.step()
    victim = next(seq for flight in engine._flight if flight for seq, _ in flight[0])
    assert victim.seq_id in engine.scheduler.in_flight
    handles[victim.seq_id].cancel()
    assert victim.seq_id not in engine.scheduler.in_flight and \
        victim not in engine.scheduler.running
    assert victim.blocks == [] or all(b not in victim.blocks for s in engine.scheduler.running
                                      for b in s.blocks)
    engine.run_until_idle()
    assert engine.kv.num_used == 0
    outs = [[out for out in h] for h in handles]
    assert outs[victim.seq_id][-1].finish_reason == "abort"
    for i, h in enumerate(outs):
        if i != victim.seq_id:
            assert [t for out in h for t in out.token_ids] == want[i]
