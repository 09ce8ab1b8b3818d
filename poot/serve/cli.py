"""The poot-serve program (also `python -m poot serve`): flags, startup in order, signals, exit.

Startup: check the flags and open the backend, bind the port (/health says loading), load the
model, plan the serving shape within the device's free memory (engine/plan.py), allocate it,
check the device's accounting against the plan, upload the weights, start the engine (/health
says serving), serve until SIGINT/SIGTERM, then stop accepting and give in-flight requests a
bounded time to finish. Every PootError ends the program through `exit_status`, the one place
where errors become a message and a status.
"""
import gc
import logging
import math
import os
import platform
import signal
import sys
import threading

from poot.backends import DeviceGroup
from poot.backends.select import BACKENDS, open_placed, parse_placement
from poot.engine import plan
from poot.engine.faults import Faults
from poot.engine.kvcache import ring_for, ring_tensors
from poot.errors import CapacityError, PootError, ServingFailed, UsageError
from poot.options import Parser, check_context, check_flags, device_memory
from poot.serve.profile import StackSampler

# The reference backend plans nothing against host memory: it serves this shape unless pinned.
REFERENCE_BLOCK_SIZE = 16
REFERENCE_STEP_TOKENS = 256
REFERENCE_MAX_SEQS = 8
REFERENCE_CONTEXT = 4096
SHUTDOWN_GRACE_S = 10.0
SWITCH_INTERVAL_S = 0.0001     # the interpreter's thread switch interval while serving
FAULTS_ENV = "POOT_INJECT_FAULTS"

log = logging.getLogger("poot.serve")


def build_parser():
    p = Parser(prog="poot-serve", description="OpenAI-compatible server for a local model.")
    p.add_argument("--model", help="GGUF file or Hugging Face folder (default: the default "
                   "model in the poot cache)")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--placement", help="pipeline:ORD,ORD,... or tensor:ORD,ORD,... (ptx only)")
    p.add_argument("--device-timing", action="store_true",
                   help="time every kernel on the device (steps run launch by launch, not "
                   "replayed); totals in /metrics")
    p.add_argument("--memory-limit", metavar="SIZE",
                   help="memory to plan within, e.g. 8GiB: caps the driver's free memory, and "
                   "is needed where the driver reports none")
    p.add_argument("--max-seqs", type=int, help="sequences decoded at once (default: the "
                   "largest that fits; reference: %d)" % REFERENCE_MAX_SEQS)
    p.add_argument("--ctx", type=int, help="context length per sequence (default: the "
                   "longest that fits, up to the model's; reference: the model's, at most "
                   f"{REFERENCE_CONTEXT})")
    p.add_argument("--prefill-chunk", type=int, help="the most tokens one step runs, prompt "
                   "chunks and decode tokens together (default: the largest that fits, of "
                   f"{', '.join(map(str, plan.STEP_TOKENS))}; reference: "
                   f"{REFERENCE_STEP_TOKENS})")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the names /v1/models lists and requests may use for the model (the "
                   "first is the one responses carry; default: the model file's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but "
                   "/health")
    p.add_argument("--profile", metavar="PATH", help="sample every thread's stack while "
                   "serving and write where the time went to PATH at exit")
    p.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt whole, "
                   "never reusing the KV blocks of one that began alike")
    p.add_argument("--no-launch-ahead", action="store_true", help="launch each step only "
                   "after the last one lands (by default, where every sequence of the step in "
                   "flight chooses its token on the device, the next is launched on those tokens "
                   "before it lands: ptx, and vulkan on a discrete GPU)")
    return p


def reference_blocks(model, context, max_seqs, memory_limit, ring=None):
    """The reference backend's KV blocks: a full context for every sequence, or as many as
    `memory_limit` holds of its float32 cache beside the window layers' rings, if any
    (at least one full context, else a capacity error). The reference plans nothing else
    against host memory."""
    per_seq = -(-context // REFERENCE_BLOCK_SIZE)
    blocks = per_seq * max_seqs
    if memory_limit is not None:
        graph = model.step_graph(1, REFERENCE_BLOCK_SIZE, ring_blocks=ring.num_blocks if ring
                                 else 0)
        ringed = ring_tensors(graph)
        nbytes = {name: 4 * math.prod(t.shape) for name, t in graph.state.items()}
        block_bytes = sum(n for name, n in nbytes.items() if name not in ringed)
        ring_bytes = sum(n for name, n in nbytes.items() if name in ringed)
        blocks = min(blocks, max(memory_limit - ring_bytes, 0) // block_bytes)
        if blocks < per_seq:
            raise CapacityError(
                f"one sequence of {context} tokens needs {per_seq * block_bytes} bytes of KV "
                f"cache; --memory-limit allows {memory_limit}")
    return blocks


def describe(device, memory):
    if device is None:
        return {"name": f"host {platform.machine()} (numpy)", "backend": "reference"}
    free, total, source = memory
    return {"name": device.name, "backend": device.backend, "ordinal": device.ordinal,
            "memory_free": free, "memory_total": total, "memory_source": source}


def check_names(names):
    """--served-model-name's names (None: the model file's)."""
    if names is not None and (any(not name.strip() for name in names)
                              or len(set(names)) != len(names)):
        raise UsageError(f"--served-model-name {' '.join(names)}: names must be non-empty and "
                         "distinct")
    return names


def serve(args, stop_event):
    memory_limit = check_flags(args)
    names = check_names(args.served_model_name)
    device = open_placed(args.backend, args.placement)     # decided once, before the port opens
    if args.device_timing and "timing" not in device.features:
        raise UsageError(f"--device-timing: backend {device.backend} ({device.name}) has no "
                         "per-kernel timing (ptx, rocm and vulkan have)")
    group = isinstance(device, DeviceGroup)
    if group:
        memory = [device_memory(d, memory_limit) for d in device.devices]
        devices = [describe(d, m) for d, m in zip(device.devices, memory)]
    else:
        memory = device_memory(device, memory_limit) if device is not None else None
        devices = [describe(device, memory)]
    from poot.loader import default_model_path, load
    from poot.serve import Server

    # The engine's thread, back from waiting on the device, takes the interpreter's lock from
    # the HTTP, writer and mask threads within this long (Python's default is 5 ms, half a step).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = Server(args.host, args.port, api_key=args.api_key)
    log.info("listening on %s (loading the model)", server.url)
    try:
        model = load(args.model or default_model_path())
        check_context(args, model)
        if device is None:
            runner, shape = reference_runner(model, args, memory_limit)
        elif group:
            runner, shape = group_runner(model, device, memory, args)
        else:
            runner, shape = device_runner(model, device, memory, args)
        inject_faults(runner)
        # The model's, the runner's and the tokenizer's objects live as long as the process:
        # the collector's full passes, which hold the interpreter's lock throughout, skip them.
        gc.collect()
        gc.freeze()
        engine = server.load(model, runner, devices=devices, plan=shape,
                             max_seqs=shape["max_seqs"], step_tokens=shape["step_tokens"],
                             max_context=shape["context"], on_failure=stop_event.set,
                             served_names=names, prefix_caching=not args.no_prefix_cache,
                             ahead=not args.no_launch_ahead)
    except BaseException:
        server.close(grace=0)
        raise
    log.info("serving %s on %s: backend %s, %d sequences x %d tokens%s", model.name, server.url,
             runner.backend, engine.max_seqs, engine.context_limit, ring_note(runner))
    sampler = StackSampler(args.profile).start() if args.profile else None
    stop_event.wait()
    if sampler is not None:
        sampler.stop()
    if engine.error is not None:
        # /health says why until the port closes; the exit status tells a supervisor
        log.error("the engine serves no more: %s; draining, then exiting", engine.error)
        server.close(grace=SHUTDOWN_GRACE_S)
        raise ServingFailed(f"{engine.error}; the server drained and stopped")
    log.info("stopping: finishing in-flight requests (up to %.0f s)", SHUTDOWN_GRACE_S)
    server.close(grace=SHUTDOWN_GRACE_S)
    return 0


def ring_note(runner):
    """What the startup line says of a model whose sliding-window layers keep a ring."""
    ring = getattr(runner, "ring", None)
    if ring is None:
        return ""
    return (f"; sliding-window layers hold a ring of {ring.length} blocks a sequence (window "
            f"{ring.window}), so no prefix cache (a ring overwrites a prefix's window blocks)")


def inject_faults(runner):
    """POOT_INJECT_FAULTS (engine/faults.py's every=N, lost=N) makes steps fail on purpose, so
    that scripts/serve-check can watch the server isolate them; unset, nothing is injected."""
    text = os.environ.get(FAULTS_ENV)
    if not text:
        return
    try:
        faults = Faults.parse(text)
    except ValueError as e:
        raise UsageError(f"{FAULTS_ENV}={text!r}: {e}") from None
    log.warning("%s: injecting faults (%s)", FAULTS_ENV, faults)
    for lane in getattr(runner, "lanes", [runner]):
        lane.faults = faults


def reference_runner(model, args, memory_limit):
    """The reference runner: a model's window layers keep rings where they leave more KV
    blocks under --memory-limit (as engine/plan.py chooses), and always without one (every
    sequence holds a whole context there: rings take less)."""
    context = min(model.context_length, args.ctx or REFERENCE_CONTEXT)
    max_seqs = args.max_seqs or REFERENCE_MAX_SEQS
    step_tokens = args.prefill_chunk or REFERENCE_STEP_TOKENS
    ring = ring_for(model.window, REFERENCE_BLOCK_SIZE, max_seqs, step_tokens, context)
    fitting, refused = [], None
    for r in [ring, None] if ring is not None else [None]:
        try:
            fitting.append((reference_blocks(model, context, max_seqs, memory_limit, r), r))
        except CapacityError as e:
            refused = e
    if not fitting:
        raise refused
    # where equal, the shared blocks under a limit (they keep the prefix cache), else rings
    blocks, ring = max(fitting, key=lambda o: (o[0], (o[1] is None) == bool(memory_limit)))
    runner = model.runner(None, num_blocks=blocks, block_size=REFERENCE_BLOCK_SIZE, ring=ring)
    return runner, {"max_seqs": max_seqs, "context": context, "step_tokens": step_tokens,
                    "kv_blocks": blocks, "kv_block_size": REFERENCE_BLOCK_SIZE}


def device_runner(model, device, memory, args):
    """The runner of the planned shape: planned, allocated, checked against the device's own
    accounting, then uploaded; and the plan as /health shows it."""
    free, _, source = memory
    chosen = plan.plan(model, device, free, source, args.max_seqs, args.ctx,
                       args.prefill_chunk).require()
    runner = plan.runner_for(model, device, chosen.candidate)
    before, _ = device.held()
    runner.allocate()
    check = plan.verify(device, chosen.footprint, runner, before)
    f = chosen.footprint
    log.info("plan for %s on %s, %s free (%s):\n  %s (%d KV blocks of %d tokens)\n"
             "  weights %s + arenas %s + state %s = %s\n"
             "  checked: the allocation took %s by %s (planned %s)", model.name, device.name,
             plan.size(free), source, chosen.candidate, chosen.candidate.kv_blocks,
             plan.BLOCK_SIZE, plan.size(f.weights), plan.size(f.arenas), plan.size(f.state),
             plan.size(f.total), plan.size(check.measured), check.source,
             plan.size(check.planned))
    runner.upload()
    if args.device_timing:
        runner.time_kernels()      # every step kernel by kernel: /metrics shows device time
    return runner, dict(chosen.describe(), checked=check.describe())


def group_runner(model, group, memory, args):
    """device_runner() for a device group: planned per device (a shape fits only if it fits on
    every device), allocated, checked on every device, uploaded."""
    kind, _ = parse_placement(args.placement)
    frees = [free for free, _, _ in memory]
    chosen = plan.plan_group(model, group, kind, frees, memory[0][2], args.max_seqs,
                             args.ctx, args.prefill_chunk).require()
    runner = plan.group_runner_for(model, group, kind, chosen.candidate)
    before = [d.held()[0] for d in group.devices]
    runner.allocate()
    checks = plan.verify_group(group, chosen, runner, before)
    log.info("plan for %s on %s group %s: %s (%d KV blocks of %d tokens)", model.name, kind,
             args.placement, chosen.candidate, chosen.candidate.kv_blocks, plan.BLOCK_SIZE)
    for d, part, f, check, free in zip(group.devices, runner.parts, chosen.footprints, checks,
                                       frees):
        log.info("  %s: %s, %s free: weights %s + arenas %s + state %s = %s; checked: the "
                 "allocation took %s by %s", d.name, part.describe(), plan.size(free),
                 plan.size(f.weights), plan.size(f.arenas), plan.size(f.state),
                 plan.size(f.total), plan.size(check.measured), check.source)
    runner.upload()
    shape = chosen.describe()
    shape["placement"] = kind
    shape["lanes"] = len(runner.lanes)          # steps in flight at once (a pipeline's, one each)
    for entry, part, check in zip(shape["devices"], runner.parts, checks):
        entry.update(part=part.describe(), checked=check.describe())
    return runner, shape


def exit_status(exc):
    """The message and exit status of an error that stops the program."""
    if isinstance(exc, PootError):
        return str(exc), exc.exit_status
    if isinstance(exc, OSError):       # e.g. the port is taken
        return f"{type(exc).__name__}: {exc}", 1
    raise exc


def main(argv=None):
    stop_event = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda *_: stop_event.set())
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="poot-serve: %(message)s")
        return serve(args, stop_event)
    except (PootError, OSError) as exc:
        message, status = exit_status(exc)
        prefix = "" if message.startswith("poot-serve: ") else "poot-serve: "
        print(prefix + message, file=sys.stderr)
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
