"""scripts/bench-serve end to end: the engine's figures from scripts/bench, then poot-serve in its
own process driven by concurrent clients over HTTP, on the reference backend with a tiny model
(every mode, streamed and whole, with and without the prefix cache), and on the Vulkan device
this machine has (lavapipe in CI) through vulkan and wgpu."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import open_or_skip

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("cache", "mode", "clients", "constrained", "stream", "requests", "decode", "free",
           "bound", "all", "ttft50", "ttft90", "ttft99", "itl50", "itl90", "itl99", "latency50",
           "engine", "ratio", "step", "itl_step")


def bench_serve(tmp_path, *flags):
    """The rows of the main table, by (cache, mode, clients, stream) (a round with constrained
    clients: by (cache, mode, clients, stream, constrained)), and the whole output."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench-serve"), "--cache",
                           str(tmp_path), "--model", "tiny:F16", "--prompt-tokens", "32",
                           "--max-tokens", "12", "--engine-steps", "4", "--json",
                           str(tmp_path / "out.json"), *flags],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(COLUMNS) and cells[0] in ("on", "off"):
            row = dict(zip(COLUMNS, cells))
            key = row["cache"], row["mode"], int(row["clients"]), row["stream"]
            rows[key + ((int(row["constrained"]),) if row["constrained"] != "0" else ())] = row
    return rows, done.stdout


def number(text):
    return float(text.replace(",", ""))


def check_figures(row):
    """Positive figures, the first token before the answer's end, the engine's beside them."""
    for name in ("all", "ttft50", "ttft90", "ttft99", "latency50", "engine", "step"):
        assert number(row[name]) > 0, (name, row)
    assert number(row["ttft50"]) <= number(row["ttft90"]) <= number(row["ttft99"])
    if row["stream"] == "yes":
        assert number(row["ttft50"]) < number(row["latency50"]), row
        for name in ("decode", "itl50", "itl99", "ratio", "itl_step"):
            assert number(row[name]) >= 0 and row[name], (name, row)
        assert number(row["decode"]) > 0 and number(row["ratio"]) > 0, row
    else:       # a whole answer: its first token is its end
        assert row["ttft50"] == row["latency50"] and row["decode"] == row["itl50"] == "", row


def test_bench_serve_on_the_reference_backend(tmp_path):
    rows, out = bench_serve(tmp_path, "--backend", "reference", "--clients", "1,2",
                            "--mode", "plain,shared-prefix,multi-turn", "--turns", "3",
                            "--stream", "on,off", "--prefix-cache", "both", "--no-warmup")
    assert sorted(rows) == sorted((cache, mode, clients, stream)
                                  for cache in ("on", "off")
                                  for mode in ("plain", "shared-prefix", "multi-turn")
                                  for clients in (1, 2) for stream in ("yes", "no")), out
    for row in rows.values():
        check_figures(row)
        assert number(row["requests"]) == number(row["clients"]) * (
            3 if row["mode"] == "multi-turn" else 1), row
    assert "# shared-prefix, 2 clients, stream yes: TTFT p50 with the prefix cache" in out
    assert "# multi-turn, prefix cache on, 1 client, stream no: TTFT p50 of turn 3" in out
    results = json.loads((tmp_path / "out.json").read_text())
    assert sorted(results["servers"]) == ["off", "on"]
    assert [e["batch"] for e in results["engine"]] == [1, 2]
    # each later turn's prompt holds the one before and its answer: with the prefix cache the
    # full blocks of the one before (at least) come from it, without it none does
    for row in results["rows"]:
        if row["mode"] != "multi-turn":
            assert row["turns"] == []
            continue
        turns = row["turns"]
        assert [t["prompt_tokens"] for t in turns] == [32, 32 + 12 + 16, 32 + 2 * (12 + 16)]
        assert turns[0]["cached_tokens"] == 0
        for before, t in zip(turns, turns[1:]):
            if row["cache"] == "on":
                assert t["cached_tokens"] >= before["prompt_tokens"] // 16 * 16, row
            else:
                assert t["cached_tokens"] == 0, row


@pytest.mark.parametrize("backend, temperature", [("vulkan", 0), ("wgpu", 0), ("vulkan", 0.8)])
def test_bench_serve_on_the_vulkan_device(tmp_path, backend, temperature):
    """Greedy, and sampled (the device's candidates, the host's choice from them)."""
    open_or_skip(backend)
    rows, out = bench_serve(tmp_path, "--backend", backend, "--clients", "1,2", "--no-warmup",
                            "--memory-limit", "1GiB", "--prefill-chunk", "128",
                            "--temperature", str(temperature), "--top-p", "0.9")
    assert sorted(rows) == [("on", "plain", 1, "yes"), ("on", "plain", 2, "yes")], out
    assert f"requests at temperature {temperature:g}, top-p 0.9;" in out
    # the engine's launches after a landing, from the server's /metrics: at least a step each
    # token after a request's first, and the host's time between under a second
    for row in json.loads((tmp_path / "out.json").read_text())["rows"]:
        assert row["steps"] >= 11 and 0 < row["launch_gap"] < 1, row
        assert 0 < row["launch_gap_cpu"] < 1, row
    assert "# plain, 2 clients, stream yes: " in out and "ms between on average" in out \
        and "ms of it the engine thread's CPU time" in out
    for row in rows.values():
        check_figures(row)


def test_bench_serve_with_constrained_clients(tmp_path):
    """Constrained clients' answers follow the bench schema for --max-tokens tokens each, and
    their streams' rates stand beside the free streams' and the round with none constrained."""
    rows, out = bench_serve(tmp_path, "--backend", "reference", "--clients", "1,2",
                            "--constrained", "0,1,2", "--no-warmup", "--no-engine",
                            "--schema", "text")
    assert sorted(rows) == [("on", "plain", 1, "yes"), ("on", "plain", 1, "yes", 1),
                            ("on", "plain", 2, "yes"), ("on", "plain", 2, "yes", 1),
                            ("on", "plain", 2, "yes", 2)], out
    for key, row in rows.items():
        bound = key[4] if len(key) == 5 else 0
        assert (row["free"] != "") == (bound < key[2]) and (row["bound"] != "") == (bound > 0)
        assert number(row["decode"]) > 0, row
    assert "# 1 of 2 constrained: a free stream's decode tok/s / with none constrained = " in out
    assert "# 2 of 2 constrained: a constrained stream's / a free one's with none" in out
