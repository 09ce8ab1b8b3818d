"""Every kernel the device runner can launch, rendered for each target and checked by the
target's own tool: ptxas for PTX (sm_80 and sm_90), spirv-val for SPIR-V. Runs in CI with no
GPU; the numeric checks are in test_kernels.py."""
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from poot.codegen.ptx import PTX_CAPS, ptx_caps, render_ptx
from poot.codegen.spirv import render_spirv
from poot.engine.kernel_choice import (FEW_TOKEN_ROUNDS, PROMPT_TILES, TOKEN_GROUPS, matvec_rows,
                                       mma_choice)
from poot.ir.graph import ACTIVATIONS
from poot.kernels import choice, matmul, matvec, mma_vec, ops, softcap
from poot.kernels.lang import WGMMA
from poot.kernels.quant import DEVICE_DTYPES
from tests.test_experts import expert_kernels


# the matvec's fused variants the runner lowers to (engine/lowering.py: Matvec)
MATVEC_VARIANTS = ({}, {"residual": True}, {"norm": True}, {"norm": True, "outputs": 3},
                   {"norm": True, "outputs": 2}, {"outputs": 3}, {"norm": True, "glu": "silu"},
                   {"glu": "silu"}, {"norm": True, "glu": "gelu_tanh"})


def runner_matvecs(subgroup_size):
    """The matvecs the runner launches: every variant and token group with its rows a
    subgroup (and one a subgroup), and one-token steps with subgroups sharing a row."""
    out = []
    for d in DEVICE_DTYPES:
        for v in MATVEC_VARIANTS:
            matrices = 2 if v.get("glu") else 1
            out += [matvec.matvec(d, subgroup_size, n, rows_per=rows_per, **v)
                    for n in TOKEN_GROUPS for rows_per in {1, matvec_rows(d, n, matrices)}]
            out += [matvec.matvec(d, subgroup_size, 1, rows_per=matvec_rows(d, 1, matrices),
                                  split=split, **v)
                    for split in (2, 8) if split <= matvec.WORKGROUP // subgroup_size]
    return out


def runner_kernels(subgroup_size):
    out = runner_matvecs(subgroup_size)
    out += [matmul.split_sum(r) for r in (False, True)]
    out += [matmul.split_sum(outputs=n) for n in (2, 3)] + [matmul.split_sum(glu=a) for a in ACTIVATIONS]
    out += [ops.embedding(d) for d in DEVICE_DTYPES]
    out += [ops.rms_norm(subgroup_size), ops.rms_norm(subgroup_size, residual=True),
            ops.elementwise("add"), *(ops.elementwise("glu", a) for a in ACTIVATIONS),
            ops.gather_rows(), ops.scale(), ops.rope("normal"), ops.rope("neox"), ops.store_kv(),
            ops.rope_store_kv("normal"), ops.rope_store_kv("neox"),
            ops.rope("neox", 1.19), ops.rope_store_kv("neox", 1.19),     # LongRoPE's factor
            ops.norm_rope_store_kv("normal", subgroup_size),              # q/k norms folded in
            ops.norm_rope_store_kv("neox", subgroup_size),
            ops.attention(subgroup_size, 64), ops.attention(subgroup_size, 128),
            ops.attention_split(subgroup_size, 64), ops.attention_split(subgroup_size, 128),
            ops.attention(subgroup_size, 128, 4), ops.attention_split(subgroup_size, 128, 4),
            ops.attention(subgroup_size, 128, 4, untiled=True),
            # a decode step's rope_store_kv folded into its attention
            ops.attention(subgroup_size, 128, rope=("neox", 1.0, True)),
            ops.attention(subgroup_size, 128, 4, rope=("normal", 1.0, False)),
            ops.attention(subgroup_size, 64, rope=("neox", 1.19, False)),
            # a step too small to share KV heads: more keys a round (kernel_choice)
            ops.attention(subgroup_size, 128, rope=("neox", 1.0, True), rounds=FEW_TOKEN_ROUNDS),
            ops.attention(subgroup_size, 64, rounds=FEW_TOKEN_ROUNDS),
            ops.attention_combine(64), ops.attention_combine(128), choice.argmax(subgroup_size),
            choice.argmax_chunks(subgroup_size), choice.top_candidates(subgroup_size),
            choice.logit_edits(), choice.feed_tokens(), choice.draw(subgroup_size)]
    out += [ops.all_reduce(w, r) for w in (2, 8) for r in (False, True)]
    out += [ops.all_gather(w) for w in (2, 8)]
    out += gemma_kernels(subgroup_size)
    return out + expert_kernels(subgroup_size)


# prompt attention's tensor-core kernels (attention_tiles, attention_flash)
PROMPT_KERNELS = [make for make, _ in PROMPT_TILES.values()]


# Gemma's attention (a sliding window, soft-capped scores: Gemma 2 and 3 at head_dim 256),
# scaled embeddings and soft-capped logits (kernels/softcap.py)
GEMMA_MODS = ({"window": 4096, "softcap": 50.0}, {"window": 512}, {"softcap": 50.0})


def gemma_kernels(subgroup_size):
    out = [ops.embedding(d, scaled=True) for d in DEVICE_DTYPES] + [softcap.softcap(30.0)]
    for mods in GEMMA_MODS:
        out += [ops.attention(subgroup_size, 256, 1, **mods),
                ops.attention(subgroup_size, 256, 2, rope=("neox", 1.0, True), **mods),
                ops.attention(subgroup_size, 256, 2, untiled=True, **mods),
                ops.attention_split(subgroup_size, 256, 2, **mods)]
    return out + [ops.attention_combine(256)]


def mma_vec_shapes(variant):
    """[rows, cols] of the Llama-8B and 1B matmuls of a matvec variant: gate and up (swiglu),
    q/k/v and the output head (norm), the output and down projections (the others)."""
    if variant.get("glu"):
        return (14336, 4096), (8192, 2048)
    if variant.get("norm"):
        return (6144, 4096), (3072, 2048), (128256, 4096), (128256, 2048)
    return (4096, 4096), (4096, 14336), (2048, 2048), (2048, 8192)


def mma_kernels(dtypes=DEVICE_DTYPES):
    """The matrix kernels, which only PTX renders (SPIR-V refuses them: test_codegen_spirv.py):
    mma_tiled in each token tile, whole (with and without the residual, or stacked outputs)
    or split, on x or x16 (the runner's folded norm: tiled_norm_x16), and in the pipeline the
    runner chooses for each format on sm_80 and on sm_90a (mma_choice: wgmma); mma_vec in
    every fused variant (a norm one as the runner launches it: on x from norm_x16), in the
    shapes the runner picks for few and many rows, norm_x16 and reduce_norm_x16; attention's
    tiles (attention_tiles and attention_flash); block quants decoded to f16 for long steps
    (dequant_f16)."""
    tiled = [matmul.mma_tiled(d, residual, tokens, split, x16=x16) for d in dtypes
             for tokens in matmul.MMA_TOKEN_TILES for x16 in (False, True)
             for split, residual in ((False, False), (False, True), (True, False))]
    chosen = {}
    for d in dtypes:
        for tokens in matmul.MMA_TOKEN_TILES:
            for caps in (PTX_CAPS, ptx_caps(90)):
                variant = mma_choice(d, caps, tokens)[0]
                for kernel in [matmul.mma_tiled(d, residual, tokens, split, **variant)
                               for split, residual in ((False, False), (False, True),
                                                       (True, False))] + \
                        [matmul.mma_tiled(d, tokens=tokens, outputs=3, **variant)]:
                    chosen[kernel.name] = kernel
        variant = mma_choice(d, ptx_caps(90), matmul.WIDE_TOKENS)[0]
        if variant.get("wgmma"):        # the 256-token tile, and gated units stored by tiles
            for kernel in [matmul.mma_tiled(d, residual, matmul.WIDE_TOKENS, split, **variant)
                           for split, residual in ((False, False), (False, True),
                                                   (True, False))]:
                chosen[kernel.name] = kernel
            for tokens in (*matmul.MMA_TOKEN_TILES, matmul.WIDE_TOKENS):
                variant = mma_choice(d, ptx_caps(90), tokens)[0]
                for glu, x16 in (("silu", d), ("gelu_tanh", None)):
                    kernel = matmul.mma_tiled(d, tokens=tokens, glu=glu, glu_x16=x16, **variant)
                    chosen[kernel.name] = kernel
    tiled += list(chosen.values())
    vec = [mma_vec.mma_vec(d, **dict(shape), **mma_vec_variant(v))
           for d in mma_vec.DTYPES if d in dtypes for v in MATVEC_VARIANTS
           for shape in {tuple(mma_vec.shape(d, rows, cols, 132, tt,
                                             x16=bool(v.get("norm"))).items())
                         for rows, cols in mma_vec_shapes(v) for tt in (1, 2, 4)}]
    prep = list({k.name: k for d in mma_vec.DTYPES if d in dtypes
                 for k in (mma_vec.norm_x16(d), mma_vec.reduce_norm_x16(d, 2),
                           mma_vec.reduce_norm_x16(d, 5), mma_vec.reduce_norm_x16(d, 8),
                           matmul.split_sum(glu="silu", x16=d),
                           matmul.split_sum(glu="gelu_tanh", x16=d))}.values())
    attention = [make(d, h) for make in PROMPT_KERNELS
                 for d, h in ((64, 3), (64, 4), (128, 4), (128, 1), (128, 2), (128, 8))]
    attention += [make(256, h, **mods) for make in PROMPT_KERNELS for h in (1, 2, 8)
                  for mods in GEMMA_MODS]
    decode = [matmul.dequant_f16(d) for d in dtypes if d not in ("F16", "BF16")]
    return tiled + vec + prep + attention + decode


def mma_vec_variant(variant):
    """A matvec variant as the runner launches it on mma_vec: a norm one reads norm_x16's x
    (mma_vec has no norm variant)."""
    return dict(variant, norm=False, x16=True) if variant.get("norm") else variant


def mma_variant_kernels(dtypes=DEVICE_DTYPES):
    """The pipelines of mma_tiled under measurement (matmul.MMA_VARIANTS but the default), for
    the weights each takes (stages: F16 and BF16), in each token tile, whole or split."""
    return [matmul.mma_tiled(d, residual, tokens, split, **variant) for d in dtypes
            for variant in matmul.MMA_VARIANTS.values()
            if variant and (d in ("F16", "BF16") or not variant.get("stages"))
            for tokens in matmul.MMA_TOKEN_TILES
            for split, residual in ((False, False), (False, True), (True, False))]


# What ptxas may spill in a kernel whose name starts so (bytes of spill stores): the tensor-core
# kernels keep their tiles, sums and scores in registers; mma_vec trades a few words of spill
# for registers in some shapes (up to 20 bytes seen), never its tiles' operands (hundreds).
SPILL_BYTES = (("mma_tiled", 0), ("attention_flash", 0), ("mma_vec", 64))


def spilled_past_bound(name, report):
    """What is wrong with ptxas -v's `report` of kernel `name` by SPILL_BYTES, or None."""
    bound = next((b for start, b in SPILL_BYTES if name.startswith(start)), None)
    if bound is None:
        return None
    if bound == 0:
        held = "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report
    else:
        spilled = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
        held = bool(spilled) and max(spilled) <= bound
    return None if held else f"spills past {bound} bytes: {report}"


def check_all(commands, check=None):
    """Runs every (name, command) at once, as many as there are cores; the failures' names and
    messages (with `check`: also what check(name, output) finds wrong in a success)."""
    def run(item):
        name, command = item
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            return f"{name}: {result.stderr}"
        wrong = check and check(name, result.stdout + result.stderr)
        return wrong and f"{name}: {wrong}"
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return [failed for failed in pool.map(run, commands) if failed]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not installed")
@pytest.mark.parametrize("sm", [80, 90])
def test_every_runner_kernel_assembles_with_ptxas(tmp_path, sm):
    """Each kernel the target offers (wgmma: sm_90a only), for its architecture, spilling no
    more than SPILL_BYTES allows."""
    commands = []
    for kernel in runner_kernels(32) + mma_kernels():
        if not kernel.caps <= ptx_caps(sm):
            continue
        source = tmp_path / f"{kernel.name}.ptx"
        source.write_text(render_ptx(kernel, sm))
        arch = f"sm_{sm}" + "a" * (WGMMA in kernel.caps)
        commands.append((kernel.name, ["ptxas", f"-arch={arch}", "-v", str(source), "-o",
                                       "/dev/null"]))
    assert commands and check_all(commands, spilled_past_bound) == []


@pytest.mark.skipif(shutil.which("spirv-val") is None, reason="spirv-val is not installed")
@pytest.mark.parametrize("subgroup_size", [8, 32, 64])
@pytest.mark.parametrize("vector_loads", [False, True])     # wgpu's modules, and vulkan's
def test_every_runner_kernel_validates_with_spirv_val(tmp_path, subgroup_size, vector_loads):
    commands = []
    for kernel in runner_kernels(subgroup_size):
        module = tmp_path / f"{kernel.name}.spv"
        module.write_bytes(render_spirv(kernel, subgroup_size, vector_loads))
        commands.append((kernel.name, ["spirv-val", "--target-env", "vulkan1.1", str(module)]))
    assert commands and check_all(commands) == []
