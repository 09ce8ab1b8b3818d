"""The library's front door: a model ready to generate, in a few lines.

    import poot
    llm = poot.LLM()                                  # the default model; or LLM("x.gguf")
    print(llm.generate("The capital of France is", max_tokens=8, temperature=0).text)
    for piece in llm.stream("Once upon a time"):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi!"}]).text
    poot.LLM(max_seqs=8).generate(["A", "B"], n=2)    # prompts and choices run together

Generation runs through the same engine as the server (continuous batching, paged KV cache),
driven from the caller's thread.
"""
from dataclasses import dataclass
from numbers import Integral

from .backends.select import open_device
from .engine.request import SamplingParams
from .engine.engine import Engine
from .engine.kvcache import ring_for
from .errors import TemplateError, UsageError
from .loader import load

STEP_TOKENS = 256           # the most tokens a step computes (the runner's and the engine's)


@dataclass
class Completion:
    text: str
    token_ids: list
    prompt_token_ids: list
    finish_reason: str


class LLM:
    """A loaded model with a runner and an engine. `context` caps the tokens per sequence;
    `max_seqs` sequences (prompts, and choices of a prompt) run together in a step, each with
    room for `context` tokens in the cache; more wait their turn."""

    def __init__(self, model=None, backend="auto", context=None, block_size=16, max_seqs=1):
        if not isinstance(max_seqs, Integral) or max_seqs < 1:
            raise UsageError(f"max_seqs must be a positive integer, not {max_seqs!r}")
        device = open_device(backend)
        self.model = load(model)
        self.tokenizer = self.model.tokenizer
        context = min(context or self.model.context_length, self.model.context_length)
        # (a model's sliding-window layers: a ring a sequence, of the window and a prefill chunk)
        ring = ring_for(self.model.window, block_size, max_seqs, STEP_TOKENS, context)
        runner = self.model.runner(device, num_blocks=max_seqs * -(-context // block_size),
                                   block_size=block_size, max_tokens=STEP_TOKENS, ring=ring)
        self.engine = Engine(runner, self.tokenizer, max_seqs=max_seqs,
                             step_tokens=STEP_TOKENS, max_context=context)

    def prompt_ids(self, prompt, chat=False):
        """Token ids of a prompt: text (rendered as one user message when chat), or ids."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if chat:
            return self.chat_prompt_ids([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, add_special=True, parse_special=True)

    def chat_prompt_ids(self, messages, chat_template_kwargs=None):
        """Token ids of a conversation by the model's chat template; `chat_template_kwargs`:
        more variables for it (e.g. {"enable_thinking": False} for Qwen3 and SmolLM3)."""
        if self.model.chat_template is None:
            raise TemplateError(f"{self.model.name} has no chat template")
        text = self.model.chat_template.render(messages, add_generation_prompt=True,
                                               **(chat_template_kwargs or {}))
        # The template writes BOS itself where the model wants one.
        return self.tokenizer.encode(text, add_special=False, parse_special=True)

    def outputs(self, prompt_ids, **params):
        """The engine's Output objects for one request, as they come."""
        return self.engine.generate(prompt_ids, SamplingParams(**params))

    def stream(self, prompt, chat=False, **params):
        """Text pieces as they are generated."""
        for out in self.outputs(self.prompt_ids(prompt, chat), **params):
            if out.text:
                yield out.text

    def generate(self, prompt, chat=False, n=1, **params):
        """The Completion of a prompt (text, or token ids); with `n` > 1 a list of n choices,
        the prompt computed once and each choice sampled on its own (with a seed, choice j
        samples with seed + j). A list of prompts gives a list of those, in its order."""
        many = isinstance(prompt, (list, tuple)) and bool(prompt) and \
            not isinstance(prompt[0], Integral)
        prompts = [self.prompt_ids(p, chat) for p in (prompt if many else [prompt])]
        done = self._run(prompts, n, params)
        per_prompt = [done[i * n:(i + 1) * n] if n > 1 else done[i * n]
                      for i in range(len(prompts))]
        return per_prompt if many else per_prompt[0]

    def chat(self, messages, n=1, chat_template_kwargs=None, **params):
        """The Completion of a conversation (a list of n with `n` > 1, as generate)."""
        done = self._run([self.chat_prompt_ids(messages, chat_template_kwargs)], n, params)
        return done if n > 1 else done[0]

    def _run(self, prompts, n, params):
        """Every choice's Completion of one request of `prompts`, prompt i's choice j at i n + j."""
        handle = self.engine.submit_prompts(prompts, SamplingParams(**params), n)
        text, ids = [[] for _ in range(len(prompts) * n)], [[] for _ in range(len(prompts) * n)]
        reasons = [None] * len(text)
        try:
            for out in handle:
                text[out.index].append(out.text)
                ids[out.index] += out.token_ids
                reasons[out.index] = out.finish_reason or reasons[out.index]
        finally:
            handle.cancel()
        return [Completion("".join(text[c]), ids[c], prompts[c // n], reasons[c])
                for c in range(len(text))]
