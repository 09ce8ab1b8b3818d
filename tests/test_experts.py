"""kernels/experts.py on every device poot can open here, against the numpy reference.

Fresh random inputs each run, outputs poisoned first (tests/test_kernels.py's `run`); the route
kernels exactly (ids) or to float32 rounding, the expert matvec by the weights' format as the
dense matvec is.
"""
import re
import shutil
import subprocess

import numpy as np
import pytest

from poot.codegen.ptx import render_ptx
from poot.engine import expert_steps
from poot.engine.kernel_choice import matvec_rows
from poot.formats.quants import QUANTS, dequantize, quantize
from poot.ir import reference as ref
from poot.kernels import experts, mma_vec
from poot.kernels.matvec import matvec, matvec_grid
from poot.kernels.quant import DEVICE_DTYPES, planes, reader
from tests.test_kernels import check_x16, cuda_device, rel_err, run  # noqa: F401 (a fixture)

rng = np.random.default_rng()


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("n_experts,used", [(8, 2), (128, 8), (60, 4), (7, 7)])
def test_route(device, n_experts, used, normalize):
    """The ids exactly (top_k), the weights to float32 rounding (route_weights)."""
    T = 5
    logits = (3 * rng.standard_normal((T, n_experts))).astype(np.float32)
    logits[1, 3] = logits[1, n_experts - 1] = 12.0            # a tie: the lower index first
    sg = device.subgroup_size
    kernel = experts.route(sg, used, normalize, experts.route_slots(n_experts, sg))
    out = run(device, kernel, (T,), logits,
              np.zeros((T, used), np.int32), np.zeros((T, used), np.float32), n_experts)
    assert np.array_equal(out["ids"], ref.top_k(logits, used))
    assert rel_err(out["w"], ref.route_weights(logits, out["ids"], normalize)) < 1e-5


@pytest.mark.parametrize("n_tokens,n_experts,used", [(1, 128, 8), (64, 128, 8), (13, 6, 2)])
@pytest.mark.parametrize("norm_x16", [None, "Q4_0", "F16"])
@pytest.mark.parametrize("grouped", [True, False])
def test_route_grouped(device, n_tokens, n_experts, used, norm_x16, grouped):
    """route and expert_groups in one workgroup (a decode step's): their outputs, the same;
    with norm_x16 also each token's x normed, times the gain, rounded to f16 pairs in the
    order the format's mma_vec takes them (quant formats pair values 0-2 and 1-3 of each 4).
    Not grouped: route's outputs alone (and the x16)."""
    logits = (3 * rng.standard_normal((n_tokens, n_experts))).astype(np.float32)
    cols, eps = 264, 1e-5
    x = (3 * rng.standard_normal((n_tokens, cols))).astype(np.float32)
    gain = (1 + 0.3 * rng.standard_normal(cols)).astype(np.float32)
    normed = [] if norm_x16 is None else [x, gain, np.zeros((n_tokens, cols // 2), np.uint32)]
    sg = device.subgroup_size
    kernel = experts.route_grouped(sg, used, True, experts.route_slots(n_experts, sg), norm_x16,
                                   grouped)
    group_bufs = [np.zeros(n_experts + 1, np.int32), np.zeros(n_tokens * used, np.int32),
                  np.zeros(n_experts, np.int32)] if grouped else []
    out = run(device, kernel, (1,),
              logits, np.zeros((n_tokens, used), np.int32),
              np.zeros((n_tokens, used), np.float32), *group_bufs, *normed,
              n_experts, n_tokens, *([cols, eps] if normed else []))
    ids = ref.top_k(logits, used)
    assert np.array_equal(out["ids"], ids)
    assert rel_err(out["w"], ref.route_weights(logits, ids, True)) < 1e-5
    want = groups(device, ids, n_experts) if grouped else ()
    for name, array in zip(("offsets", "routes", "active"), want):
        assert np.array_equal(out[name], array), name
    if norm_x16 is not None:
        h = ref.rms_norm(x, gain, eps).reshape(n_tokens, -1, 4)
        if mma_vec.quant_pairs(norm_x16):
            h = h[:, :, [0, 2, 1, 3]]
        got = out["x16"].view(np.float16).reshape(h.shape).astype(np.float32)
        assert np.allclose(got, h, rtol=2e-3, atol=1e-3)


def groups(device, ids, n_experts, fours=False):
    flat = ids.reshape(-1)
    out = run(device, experts.expert_groups(fours), (1,), flat,
              np.zeros(n_experts + 1, np.int32), np.zeros(len(flat), np.int32),
              np.zeros(n_experts, np.int32), len(flat), n_experts)
    return out["offsets"], out["routes"], out["active"]


@pytest.mark.parametrize("n_tokens,n_experts,used", [(1, 128, 8), (9, 6, 2), (40, 300, 4),
                                                     (700, 128, 8)])
def test_expert_groups(device, n_tokens, n_experts, used):
    """Read one id a load, and (whole fours of routes) four a load."""
    ids = np.stack([rng.permutation(n_experts)[:used] for _ in range(n_tokens)]).astype(np.int32)
    fours = used % 4 == 0
    offsets, routes, active = groups(device, ids, n_experts, fours)
    if fours:
        assert all(np.array_equal(a, b) for a, b in zip(groups(device, ids, n_experts),
                                                         (offsets, routes, active)))
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


# (mma_vec keywords, tokens, experts, used, rows, cols): one token's routes, a step's of more
# routes an expert than a pass takes (passes in a loop, split ones' shared sums reused), rows
# that are not whole tiles, columns not whole 128-column groups, pipelined rounds
EXPERT_MMA_CASES = [({"glu": "silu", "x16": True, "tiles": 2, "split": 2}, 1, 8, 2, 96, 512),
                    ({"tiles": 2, "split": 4}, 1, 8, 2, 200, 576),
                    ({"glu": "silu", "x16": True, "split": 2}, 40, 6, 2, 40, 576),
                    ({"tiles": 2, "split": 8}, 40, 6, 2, 96, 256),
                    ({"glu": "silu", "x16": True, "token_tiles": 4, "unroll": 2}, 64, 4, 3, 48,
                     1024),
                    ({"chains": 2, "pipeline": True, "unroll": 2}, 9, 6, 2, 40, 4096),
                    # one token's routes, each its own workgroup column (by_route)
                    ({"glu": "silu", "x16": True, "split": 8, "unroll": 2, "by_route": True},
                     1, 16, 8, 96, 2048),
                    ({"tiles": 2, "split": 4, "by_route": True}, 1, 8, 3, 200, 576)]


@pytest.mark.parametrize("dtype", mma_vec.DTYPES)
@pytest.mark.parametrize("variant,n_tokens,n_experts,used,rows,cols", EXPERT_MMA_CASES)
def test_expert_mma_vec(cuda_device, dtype, variant, n_tokens, n_experts, used, rows, cols):
    """mma_vec's expert variant (the experts' matvec on ptx): gate/up from norm_x16's words of
    each token (every route of a token reads its row), down from each route's own f32 x; the
    bounds of test_kernels.test_mma_vec in relative norm (operands rounded to 16 bits)."""
    if cols % QUANTS[dtype].block_elems:
        pytest.skip(f"{dtype} rows are whole blocks of {QUANTS[dtype].block_elems}")
    glu, x16 = variant.get("glu"), variant.get("x16", False)
    ids = np.stack([rng.permutation(n_experts)[:used] for _ in range(n_tokens)]).astype(np.int32)
    offsets, routes, active = groups(cuda_device, ids, n_experts)
    x = rng.standard_normal((n_tokens, cols) if x16 else (n_tokens, used, cols))
    x = x.astype(np.float32)
    gain = (1 + 0.3 * rng.standard_normal(cols)).astype(np.float32)
    x_in = x
    if x16:
        x_in = run(cuda_device, mma_vec.norm_x16(dtype), (n_tokens,), x, gain,
                   np.zeros((n_tokens, cols // 2), np.uint32), cols, 1e-5)["x16"]
        x = ref.rms_norm(x, gain, 1e-5)
    weights = [stacked_weight(dtype, n_experts, rows, cols) for _ in range(2 if glu else 1)]
    kernel = mma_vec.mma_vec(dtype, experts=True, **variant)
    grid = (mma_vec.grid(rows, 1, variant.get("tiles", 1), variant.get("split", 1))[0],
            min(n_experts, n_tokens * used))
    by_route = variant.get("by_route")
    taken = [ids] if by_route else [offsets, routes, active]
    got = run(cuda_device, kernel, grid, *[p for w, _ in weights for p in w], x_in, *taken,
              np.zeros((n_tokens, used, rows), np.float32), rows, cols,
              used if x16 else 1, *([n_experts] if by_route else []))["y"]
    want = ref.expert_matmul(x, weights[0][1], ids)
    if glu:
        want = ref.glu(want, ref.expert_matmul(x, weights[1][1], ids), glu)
    assert rel_err(got, want) < (2e-2 if dtype == "BF16" else 3e-3), kernel.name


def test_expert_mma_vec_by_route_in_lockstep():
    """mma_vec's by_route expert variant at one token, run by numpy (tests/lockstep.py): each
    route's rows of its expert, gate/up from norm_x16's words (every route reads the token's)
    and down from the route's own x; a route whose id is no expert's (a router of NaN logits
    chooses id n) writes nothing, as the grouping leaves it."""
    from tests import lockstep
    n_experts, used, rows, cols = 6, 3, 40, 256
    ids = rng.permutation(n_experts)[:used].astype(np.int32).reshape(1, used)
    ids[0, 1] = n_experts
    for glu in ("silu", None):
        x = rng.standard_normal((1, cols) if glu else (1, used, cols)).astype(np.float32)
        x_in = x
        if glu:
            gain = (1 + 0.3 * rng.standard_normal(cols)).astype(np.float32)
            x_in = np.zeros((1, cols // 2), np.uint32)
            lockstep.run(mma_vec.norm_x16("Q4_0"), (1,), x, gain, x_in, cols, 1e-5)
            x = ref.rms_norm(x, gain, 1e-5)
        weights = [stacked_weight("Q4_0", n_experts, rows, cols) for _ in range(2 if glu else 1)]
        shape = mma_vec.shape("Q4_0", rows * used, cols, 132, experts=True, x16=bool(glu))
        kernel = mma_vec.mma_vec("Q4_0", glu=glu, x16=bool(glu), experts=True, by_route=True,
                                 **shape)
        y = np.full((1, used, rows), np.nan, np.float32)
        lockstep.run(kernel, (mma_vec.grid(rows, 1, shape["tiles"], shape["split"])[0], used),
                     *[p for w, _ in weights for p in w], x_in, ids, y, rows, cols,
                     used if glu else 1, n_experts)
        assert np.isnan(y[0, 1]).all()
        chosen = ids[:, [0, 2]]
        want = ref.expert_matmul(x if glu else x[:, [0, 2]], weights[0][1], chosen)
        if glu:
            want = ref.glu(want, ref.expert_matmul(x, weights[1][1], chosen), glu)
        assert rel_err(y[:, [0, 2]], want) < 3e-3, kernel.name


# (experts, used, normalize, edit): a router's 128 experts with a three-way tie across a
# lane's logits; NaN logits (never chosen) with the softmax over all; fewer logits above
# LOWEST than routes (id n: that route's launch writes no rows)
CHOOSE_CASES = [(128, 8, True, "tie"), (60, 4, False, "nan"), (8, 3, True, "few")]


def choosing_case(n_experts, used, normalize, edit):
    """(logits [1, n_experts], kernel, grid, x16 of x, x normed, weights) of one token's gate/up
    mma_vec that chooses its routes (by_route with choose), rows that are not whole tiles."""
    rows, cols = 40, 256
    logits = (3 * rng.standard_normal((1, n_experts))).astype(np.float32)
    if edit == "tie":
        logits[0, [3, 35, n_experts - 1]] = 12.0
    elif edit == "nan":
        logits[0, ::3] = np.nan
    else:
        logits[0, 2:] = -np.inf
    x = rng.standard_normal((1, cols)).astype(np.float32)
    gain = (1 + 0.3 * rng.standard_normal(cols)).astype(np.float32)
    x16 = np.zeros((1, cols // 2), np.uint32)
    from tests import lockstep
    lockstep.run(mma_vec.norm_x16("Q4_0"), (1,), x, gain, x16, cols, 1e-5)
    weights = [stacked_weight("Q4_0", n_experts, rows, cols) for _ in range(2)]
    shape = mma_vec.shape("Q4_0", rows * used, cols, 132, experts=True, x16=True)
    choose = (used, normalize, experts.route_slots(n_experts, mma_vec.SUBGROUP))
    kernel = mma_vec.mma_vec("Q4_0", glu="silu", x16=True, experts=True, by_route=True,
                             choose=choose, **shape)
    grid = (mma_vec.grid(rows, 1, shape["tiles"], shape["split"])[0], used)
    return logits, kernel, grid, x16, ref.rms_norm(x, gain, 1e-5), weights, rows, cols


def check_choice(out, logits, want_ids, want_w, x, weights, n_experts):
    """The choosing launch's ids and weights, bit for bit those of the route kernel; each
    route's rows of its expert (none for a route of id n)."""
    assert np.array_equal(out["ids"], want_ids)
    assert np.array_equal(out["w"], want_w, equal_nan=True)
    taken = want_ids[0] < n_experts
    chosen = want_ids[:, taken]
    want = ref.glu(ref.expert_matmul(x, weights[0][1], chosen),
                   ref.expert_matmul(x, weights[1][1], chosen), "silu")
    assert rel_err(out["y"][:, taken], want) < 3e-3
    return taken


@pytest.mark.parametrize("n_experts,used,normalize,edit", CHOOSE_CASES)
def test_an_expert_mma_vec_chooses_its_routes_as_the_route_kernel(cuda_device, n_experts, used,
                                                                  normalize, edit):
    """mma_vec's choosing by_route variant (a one-token step's gate/up, no route launch): the
    ids and weights of experts.route, bit for bit, written by each route's first workgroup,
    and each route's rows of the expert it chose."""
    logits, kernel, grid, x16, x, weights, rows, cols = choosing_case(n_experts, used,
                                                                      normalize, edit)
    slots = experts.route_slots(n_experts, cuda_device.subgroup_size)
    want = run(cuda_device, experts.route(cuda_device.subgroup_size, used, normalize, slots),
               (1,), logits, np.zeros((1, used), np.int32), np.zeros((1, used), np.float32),
               n_experts)
    out = run(cuda_device, kernel, grid, *[p for w, _ in weights for p in w], x16, logits,
              np.zeros((1, used), np.int32), np.zeros((1, used), np.float32),
              np.zeros((1, used, rows), np.float32), rows, cols, used, n_experts)
    taken = check_choice(out, logits, want["ids"], want["w"], x, weights, n_experts)
    assert taken.all() == (edit != "few")


@pytest.mark.parametrize("n_experts,used,normalize,edit", CHOOSE_CASES)
def test_an_expert_mma_vec_chooses_its_routes_in_lockstep(n_experts, used, normalize, edit):
    """The same, both kernels run by numpy at 32 lanes (tests/lockstep.py); a route of id n
    leaves its rows as they were."""
    from tests import lockstep
    logits, kernel, grid, x16, x, weights, rows, cols = choosing_case(n_experts, used,
                                                                      normalize, edit)
    want_ids, want_w = np.zeros((1, used), np.int32), np.zeros((1, used), np.float32)
    lockstep.run(experts.route(32, used, normalize, experts.route_slots(n_experts, 32)), (1,),
                 logits, want_ids, want_w, n_experts)
    out = {"ids": np.full((1, used), -7, np.int32), "w": np.full((1, used), -7, np.float32),
           "y": np.full((1, used, rows), np.inf, np.float32)}
    lockstep.run(kernel, grid, *[p for w, _ in weights for p in w], x16, logits, out["ids"],
                 out["w"], out["y"], rows, cols, used, n_experts)
    taken = check_choice(out, logits, want_ids, want_w, x, weights, n_experts)
    assert np.isinf(out["y"][:, ~taken]).all()


@pytest.mark.parametrize("dtype", ["Q4_0", "F16"])
def test_a_router_matvec_makes_its_experts_x16(device, dtype):
    """The router's f32 matvec with normed_out: its logits, bit for bit those of the plain
    norm variant, and from its one workgroup more norm_x16's words of x for the experts'
    mma_vec of that format, bit for bit."""
    n_experts, cols, eps = 128, 2048, 1e-6
    w = rng.standard_normal((n_experts, cols)).astype(np.float32)
    x = (3 * rng.standard_normal((1, cols))).astype(np.float32)
    gain = (1 + 0.3 * rng.standard_normal(cols)).astype(np.float32)
    sg = device.subgroup_size
    plain = matvec("F32", sg, 1, norm=True)
    kernel = matvec("F32", sg, 1, norm=True, normed_out=dtype)
    if not kernel.caps <= device.caps:
        pytest.skip(f"{kernel.name} needs {sorted(kernel.caps - device.caps)}")
    width, height = matvec_grid(n_experts, 1, sg)
    args = (w.view(np.uint32), x, gain, np.zeros((1, n_experts), np.float32), n_experts, cols,
            1, eps)
    want = run(device, plain, (width, height), *args)["y"]
    out = run(device, kernel, (width + 1, height), *args, np.zeros((1, cols // 2), np.uint32))
    words = run(device, mma_vec.norm_x16(dtype, sg), (1,), x, gain,
                np.zeros((1, cols // 2), np.uint32), cols, eps)["x16"]
    assert np.array_equal(out["y"], want) and np.array_equal(out["x16"], words)


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


@pytest.mark.parametrize("dtype", ["Q4_0", "F16"])
@pytest.mark.parametrize("n_tokens,used,cols", [(1, 8, 2048), (5, 2, 264)])
def test_expert_sum_norm_x16(device, dtype, n_tokens, used, cols):
    """expert_sum_norm_x16: out the same bits as expert_sum's with its residual, and the
    norm_x16 words of it."""
    check_expert_sum_norm_x16(device, dtype, n_tokens, used, cols)


def test_expert_sum_norm_x16_bf16(cuda_device):
    """The bf16 words a BF16 model's mma_tiled reads (a long step's; wgpu has no 16-bit
    integers, and only ptx runs them)."""
    check_expert_sum_norm_x16(cuda_device, "BF16", 3, 8, 520)


def check_expert_sum_norm_x16(device, dtype, n_tokens, used, cols):
    eps = 1e-5
    y = rng.standard_normal((n_tokens, used, cols)).astype(np.float32)
    w = rng.random((n_tokens, used)).astype(np.float32)
    res = (3 * rng.standard_normal((n_tokens, cols))).astype(np.float32)
    g = rng.standard_normal(cols).astype(np.float32)
    got = run(device, experts.expert_sum_norm_x16(used, dtype, device.subgroup_size),
              (n_tokens,), y, w, res, np.full((n_tokens, cols), np.nan, np.float32), g,
              np.zeros((n_tokens, cols // 2), np.uint32), cols, eps)
    summed = run(device, experts.expert_sum(used, True), (-(-n_tokens * cols // experts.WG),),
                 y, w, res, np.zeros((n_tokens, cols), np.float32), n_tokens, cols)["out"]
    assert np.array_equal(got["out"], summed)
    assert rel_err(got["out"], ref.expert_sum(y, w) + res) < 1e-6
    check_x16(got["x16"], got["out"], g, eps, dtype)


def expert_kernels(subgroup_size):
    """The expert kernels the runner launches (engine/expert_steps.py), in each format and
    token group (test_kernel_sources' sweeps assemble and validate them with the others)."""
    slots = experts.route_slots(128, subgroup_size)
    out = [experts.route(subgroup_size, 8, True, slots), experts.route(subgroup_size, 2, False, 1),
           experts.route_grouped(subgroup_size, 8, True, slots),
           experts.route_grouped(subgroup_size, 2, False, 1), experts.expert_groups(),
           experts.expert_groups(fours=True),
           experts.route_grouped(subgroup_size, 8, True, slots, "Q4_0"),
           experts.route_grouped(subgroup_size, 8, True, slots, "F16"),
           experts.route_grouped(subgroup_size, 8, True, slots, "Q4_0", grouped=False),
           experts.expert_sum(8), experts.expert_sum(8, residual=True),
           experts.expert_sum_norm_x16(8, "Q4_0"), experts.expert_sum_norm_x16(8, "F16"),
           experts.expert_sum_norm_x16(8, "BF16")]
    out += [matvec("F32", subgroup_size, 1, rows_per=matvec_rows("F32", 1, 1), norm=True,
                   normed_out=d) for d in ("Q4_0", "F16")]      # a router making the x16
    return out + [experts.expert_matvec(d, subgroup_size, tokens, glu, rows_per, glu is not None)
                  for d in DEVICE_DTYPES for tokens in experts.expert_tokens(d)
                  for glu in (None, "silu")
                  for rows_per in {1, matvec_rows(d, tokens, 2 if glu else 1)}]


def expert_mma_kernels(dtype, multiprocessors=132):
    """The expert mma_vec kernels a ptx runner of a Qwen3-30B-A3B-shaped model launches (128
    experts, 8 used, d_model 2048, expert width 768) in steps of 1 to 512 tokens."""
    out = {}
    for glu, rows, cols in (("silu", 768, 2048), (None, 2048, 768)):
        for T in range(1, 513):
            _, shape = expert_steps.mma_shape(dtype, 128, rows, cols, 8, multiprocessors, T,
                                              x16=glu is not None)
            for by_route in (False, True) if T == 1 else (False,):
                kernel = mma_vec.mma_vec(dtype, glu=glu, x16=glu is not None, experts=True,
                                         by_route=by_route, **shape)
                out[kernel.name] = kernel
            if T == 1 and glu:          # a one-token step's gate/up, choosing its routes
                kernel = mma_vec.mma_vec(dtype, glu=glu, x16=True, experts=True, by_route=True,
                                         choose=(8, True, 4), **shape)
                out[kernel.name] = kernel
    return list(out.values())


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not installed")
@pytest.mark.parametrize("sm", [80, 90])
@pytest.mark.parametrize("dtype", mma_vec.DTYPES)
def test_expert_mma_vec_assembles_with_few_spills(tmp_path, dtype, sm):
    """Each expert mma_vec the runner launches, assembled as the dense mma_vec's are checked
    (test_kernel_sources.SPILL_BYTES): at most a few words spilled."""
    for kernel in expert_mma_kernels(dtype):
        source = tmp_path / f"{kernel.name}.ptx"
        source.write_text(render_ptx(kernel, sm))
        result = subprocess.run(["ptxas", f"-arch=sm_{sm}", "-v", str(source), "-o", "/dev/null"],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{kernel.name}: {result.stderr}"
        spilled = [int(n) for n in re.findall(r"(\d+) bytes spill stores", result.stderr)]
        assert spilled and max(spilled) <= 64, f"{kernel.name}: {result.stderr}"


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
