"""The `poot` command: generate, tokenize, chat-template, plan, devices, serve.

Every error a person can act on is a PootError; `main` turns it into one line on standard error
and its exit status (poot/errors.py). `poot serve` is the same program as `poot-serve`.
"""
import json
import sys
import time

from .errors import PootError, UsageError
from .options import Parser


def build_parser():
    parser = Parser(prog="poot", description="LLM inference on the vendors' own GPU drivers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", help="GGUF file or Hugging Face folder (default: the default model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true",
                     help="treat the prompt as one user message and apply the model's template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--backend", default="auto")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object instead of streaming text")

    tok = sub.add_parser("tokenize", help="print token ids as a JSON array")
    tok.add_argument("--model")
    tok.add_argument("--no-special", action="store_true",
                     help="treat special-token text as plain text")
    tok.add_argument("text", nargs="?",
                     help="text to tokenize; without it, one JSON string per line on stdin")

    tpl = sub.add_parser("chat-template",
                         help="render a JSON list of messages (stdin) with the model's template")
    tpl.add_argument("--model")

    pln = sub.add_parser("plan", help="print every serving shape's memory footprint against "
                         "the device's free memory, the chosen one marked (a dry run: no weights "
                         "reach the device)")
    pln.add_argument("model_path", nargs="?", metavar="MODEL",
                     help="GGUF file or Hugging Face folder (or --model; default: the default "
                     "model)")
    pln.add_argument("--model", help="the same as MODEL")
    pln.add_argument("--backend", default="auto")
    pln.add_argument("--placement", help="pipeline:ORD,... or tensor:ORD,... (as poot-serve)")
    pln.add_argument("--memory-limit", metavar="SIZE", help="memory to plan within, e.g. 8GiB")
    pln.add_argument("--max-seqs", type=int, help="pin the sequences decoded at once")
    pln.add_argument("--ctx", type=int, help="pin the context length per sequence")
    pln.add_argument("--prefill-chunk", type=int, help="pin the most tokens a step runs")
    pln.set_defaults(device_timing=False, port=0)

    sub.add_parser("devices", help="the toolchain check: driver libraries, devices, memory, "
                   "capabilities, codegen targets")

    sub.add_parser("serve", help="the OpenAI-compatible server (same as poot-serve)",
                   add_help=False)
    return parser


def cmd_generate(args):
    from .llm import LLM
    llm = LLM(args.model, backend=args.backend)
    prompt_ids = llm.prompt_ids(args.prompt, chat=args.chat)
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop))
    start = time.perf_counter()
    text, ids, reason = [], [], None
    for out in llm.outputs(prompt_ids, **params):
        ids += out.token_ids
        text.append(out.text)
        reason = out.finish_reason or reason
        if not args.json and out.text:
            print(out.text, end="", flush=True)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": ids,
                          "text": "".join(text), "finish_reason": reason}, ensure_ascii=False))
    else:
        print(f"\n[{len(ids)} tokens in {seconds:.2f} s: {len(ids) / seconds:.1f} tokens/s, "
              f"{len(prompt_ids)} prompt tokens, finish: {reason}]", file=sys.stderr)
    return 0


def cmd_tokenize(args):
    from .loader import load
    tokenizer = load(args.model, weights=False).tokenizer

    def ids(text):
        return tokenizer.encode(text, add_special=True, parse_special=not args.no_special)

    if args.text is not None:
        print(json.dumps(ids(args.text)))
        return 0
    for number, line in enumerate(sys.stdin, 1):
        try:
            text = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"stdin line {number}: not a JSON string ({e.msg})") from None
        if not isinstance(text, str):
            raise UsageError(f"stdin line {number}: expected a JSON string")
        print(json.dumps(ids(text)), flush=True)
    return 0


def cmd_chat_template(args):
    from .errors import TemplateError
    from .loader import load
    model = load(args.model, weights=False)
    if model.chat_template is None:
        raise TemplateError(f"{model.name} has no chat template")
    try:
        messages = json.load(sys.stdin)
    except json.JSONDecodeError as e:
        raise UsageError(f"stdin: not JSON ({e.msg})") from None
    sys.stdout.write(model.chat_template.render(messages, add_generation_prompt=True))
    return 0


def cmd_plan(args):
    """The plan poot-serve would make with these flags, every candidate printed; exit 6 when
    none fits or the free memory is unknown (the table still shows what each would need)."""
    from .backends import DeviceGroup
    from .backends.select import open_placed, parse_placement
    from .engine import plan
    from .errors import CapacityError
    from .loader import load
    from .options import check_context, check_flags, device_memory
    if args.model_path and args.model and args.model_path != args.model:
        raise UsageError(f"plan: two models given ({args.model_path} and --model {args.model})")
    args.model = args.model or args.model_path
    memory_limit = check_flags(args)
    device = open_placed(args.backend, args.placement)
    if device is None:
        print("backend reference: the numpy interpreter plans nothing against host memory; it "
              "serves --max-seqs x --ctx (default 8 x the model's context, at most 4096)")
        return 0
    unknown = None
    model = load(args.model)
    check_context(args, model)
    if isinstance(device, DeviceGroup):
        memory = [device_memory(d, memory_limit) for d in device.devices]
        kind, _ = parse_placement(args.placement)
        result = plan.plan_group(model, device, kind, [m[0] for m in memory], memory[0][2],
                                 args.max_seqs, args.ctx, args.prefill_chunk)
    else:
        try:
            free, _, source = device_memory(device, memory_limit)
        except CapacityError as e:
            unknown, free, source = e, None, device.memory_source
        result = plan.plan(model, device, free, source, args.max_seqs, args.ctx,
                           args.prefill_chunk)
    print(f"plan for {model.name} on {device.name}")
    print("\n".join(result.lines()))
    if unknown is not None:
        raise unknown
    result.require()
    print(f"chosen: {result.candidate}, {plan.size(result.footprint.total)}")
    return 0


def cmd_devices(args):
    from .backends import toolchain
    return toolchain.report(sys.stdout)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["serve"]:
            from .serve.cli import main as serve_main
            return serve_main(argv[1:])
        args = build_parser().parse_args(argv)
        return {"generate": cmd_generate, "tokenize": cmd_tokenize,
                "chat-template": cmd_chat_template, "plan": cmd_plan,
                "devices": cmd_devices}[args.command](args)
    except PootError as e:
        print(f"poot: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        return 130
