"""kernels/experts.py on every device poot can open here, against the numpy reference.

Fresh random inputs each run, outputs poisoned first (tests/test_kernels.py's `run`); the route
kernels exactly (ids) or to float32 rounding, the expert matvec by the weights' format as the
dense matvec is.
"""
import shutil
import subprocess

import numpy as np
import pytest

from poot.codegen.ptx import render_ptx
from poot.engine.kernel_choice import matvec_rows
from poot.formats.quants import dequantize, quantize
from poot.ir import reference as ref
from poot.kernels import experts
from poot.kernels.quant import DEVICE_DTYPES, planes, reader
from tests.test_kernels import rel_err, run

rng = np.random.default_rng()


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("n_experts,used", [(8, 2), (128, 8), (60, 4), (7, 7)])
def test_route(device, n_experts, used, normalize):
    """The ids exactly (top_k), the weights to float32 rounding (route_weights)."""
    T = 5
    logits = (3 * rng.standard_normal((T, n_experts))).astype(np.float32)
    logits[1, 3] = logits[1, n_experts - 1] = 12.0            # a tie: the lower index first
    out = run(device, experts.route(device.subgroup_size, used, normalize), (T,), logits,
              np.zeros((T, used), np.int32), np.zeros((T, used), np.float32), n_experts)
    assert np.array_equal(out["ids"], ref.top_k(logits, used))
    assert rel_err(out["w"], ref.route_weights(logits, out["ids"], normalize)) < 1e-5


@pytest.mark.parametrize("n_tokens,n_experts,used", [(1, 128, 8), (64, 128, 8), (13, 6, 2)])
def test_route_grouped(device, n_tokens, n_experts, used):
    """route and expert_groups in one workgroup (a decode step's): their outputs, the same."""
    logits = (3 * rng.standard_normal((n_tokens, n_experts))).astype(np.float32)
    out = run(device, experts.route_grouped(device.subgroup_size, used, True), (1,), logits,
              np.zeros((n_tokens, used), np.int32), np.zeros((n_tokens, used), np.float32),
              np.zeros(n_experts + 1, np.int32), np.zeros(n_tokens * used, np.int32),
              np.zeros(n_experts, np.int32), n_experts, n_tokens)
    ids = ref.top_k(logits, used)
    assert np.array_equal(out["ids"], ids)
    assert rel_err(out["w"], ref.route_weights(logits, ids, True)) < 1e-5
    want = groups(device, ids, n_experts)
    for name, array in zip(("offsets", "routes", "active"), want):
        assert np.array_equal(out[name], array), name


def groups(device, ids, n_experts):
    flat = ids.reshape(-1)
    out = run(device, experts.expert_groups(), (1,), flat, np.zeros(n_experts + 1, np.int32),
              np.zeros(len(flat), np.int32), np.zeros(n_experts, np.int32), len(flat),
              n_experts)
    return out["offsets"], out["routes"], out["active"]


@pytest.mark.parametrize("n_tokens,n_experts,used", [(1, 128, 8), (9, 6, 2), (40, 300, 4)])
def test_expert_groups(device, n_tokens, n_experts, used):
    ids = np.stack([rng.permutation(n_experts)[:used] for _ in range(n_tokens)]).astype(np.int32)
    offsets, routes, active = groups(device, ids, n_experts)
    flat = ids.reshape(-1)
    for e in range(n_experts):
        assert routes[offsets[e]:offsets[e + 1]].tolist() == np.nonzero(flat == e)[0].tolist()
    assert offsets[-1] == len(flat)
    chosen = np.unique(flat).tolist()
    assert active.tolist() == chosen + [-1] * (n_experts - len(chosen))


def stacked_weight(dtype, n_experts, rows, cols):
    values = rng.standard_normal((n_experts * rows, cols)).astype(np.float32)
    raw = quantize(dtype, values).reshape(n_experts * rows, -1)
    p = planes(dtype, raw, (n_experts * rows, cols))
    dense = dequantize(dtype, raw, (n_experts * rows, cols)).reshape(n_experts, rows, cols)
    return [p[name] for name in reader(dtype).plane_names], dense


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("n_tokens,tokens,glu,per_route,rows_per,norm", [
    (1, 1, None, False, 1, False), (1, 1, "silu", False, 2, True), (1, 1, None, True, 4, False),
    (7, 4, "silu", False, 1, True), (5, 2, None, True, 3, False), (12, 8, None, True, 1, False)])
def test_expert_matvec(device, dtype, n_tokens, tokens, glu, per_route, rows_per, norm):
    """x per token (gate/up: every route of a token reads its row, RMS-normalised first with
    `norm`) or per route (down); a subgroup's rows_per rows (3: the last subgroup holds fewer
    than that); the token groups a format takes (experts.expert_tokens)."""
    tokens = max(g for g in experts.expert_tokens(dtype) if g <= tokens)
    n_experts, used, rows, cols = 6, 2, 40, 256
    ids = np.stack([rng.permutation(n_experts)[:used] for _ in range(n_tokens)]).astype(np.int32)
    offsets, routes, active = groups(device, ids, n_experts)
    x = rng.standard_normal((n_tokens, used, cols) if per_route else (n_tokens, cols))
    x = x.astype(np.float32)
    weights = [stacked_weight(dtype, n_experts, rows, cols) for _ in range(2 if glu else 1)]
    args = [p for w_planes, _ in weights for p in w_planes]
    kernel = experts.expert_matvec(dtype, device.subgroup_size, tokens, glu, rows_per, norm)
    grid = experts.expert_grid(rows, min(n_experts, n_tokens * used), device.subgroup_size,
                               rows_per)
    gain = (1 + 0.3 * rng.standard_normal(cols)).astype(np.float32)
    got = run(device, kernel, grid, *args, x, *([gain] if norm else []), offsets, routes,
              active, np.zeros((n_tokens, used, rows), np.float32), rows, cols,
              1 if per_route else used, *([1e-5] if norm else []))["y"]
    if norm:
        x = ref.rms_norm(x, gain, 1e-5)
    want = ref.expert_matmul(x, weights[0][1], ids)
    if glu:
        want = ref.glu(want, ref.expert_matmul(x, weights[1][1], ids), glu)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("residual", [False, True])
def test_expert_sum(device, residual):
    T, used, cols = 7, 3, 96
    y = rng.standard_normal((T, used, cols)).astype(np.float32)
    w = rng.random((T, used)).astype(np.float32)
    res = rng.standard_normal((T, cols)).astype(np.float32)
    args = (y, w, res) if residual else (y, w)
    got = run(device, experts.expert_sum(used, residual), (-(-T * cols // experts.WG),), *args,
              np.zeros((T, cols), np.float32), T, cols)["out"]
    want = ref.expert_sum(y, w) + (res if residual else 0)
    assert rel_err(got, want) < 1e-6


def expert_kernels(subgroup_size):
    """The expert kernels the runner launches (engine/expert_steps.py), in each format and
    token group."""
    out = [experts.route(subgroup_size, 8, True), experts.route(subgroup_size, 2, False),
           experts.route_grouped(subgroup_size, 8, True),
           experts.route_grouped(subgroup_size, 2, False), experts.expert_groups(),
           experts.expert_sum(8), experts.expert_sum(8, residual=True)]
    return out + [experts.expert_matvec(d, subgroup_size, tokens, glu, rows_per, glu is not None)
                  for d in DEVICE_DTYPES for tokens in experts.expert_tokens(d)
                  for glu in (None, "silu")
                  for rows_per in {1, matvec_rows(d, tokens, 2 if glu else 1)}]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not installed")
@pytest.mark.parametrize("sm", [80, 90])
def test_expert_kernels_assemble_with_ptxas(tmp_path, sm):
    for kernel in expert_kernels(32):
        source = tmp_path / f"{kernel.name}.ptx"
        source.write_text(render_ptx(kernel, sm))
        result = subprocess.run(["ptxas", f"-arch=sm_{sm}", str(source), "-o", "/dev/null"],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{kernel.name}: {result.stderr}"


@pytest.mark.parametrize("isa,wavefront", [("gfx90a", 64), ("gfx1030", 32)])
def test_expert_kernels_build_for_amd_without_scratch(isa, wavefront):
    """comgr builds each expert kernel into a code object (skipped without libamd_comgr)."""
    from drivers import LibraryNotFound
    from poot.codegen.amdgpu import build_code_object, compiler_isas
    try:
        compiler_isas()
    except LibraryNotFound as error:
        pytest.skip(f"libamd_comgr not found (tried {', '.join(p for p, _ in error.tried)})")
    for kernel in expert_kernels(wavefront):
        code = build_code_object(kernel, isa, wavefront)
        assert code.group_segment_size == kernel.shared_bytes, kernel.name
        assert code.private_segment_size == 0, f"{kernel.name} spills to scratch"
