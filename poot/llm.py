"""The library's front door: a model ready to generate, in a few lines.

    import poot
    llm = poot.LLM()                                  # the default model; or LLM("x.gguf")
    print(llm.generate("The capital of France is", max_tokens=8, temperature=0).text)
    for piece in llm.stream("Once upon a time"):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi!"}]).text

Generation runs through the same engine as the server (continuous batching, paged KV cache),
driven from the caller's thread.
"""
from dataclasses import dataclass

from .backends.select import open_device
from .engine.request import SamplingParams
from .engine.engine import Engine
from .engine.kvcache import ring_for
from .errors import TemplateError
from .loader import load

STEP_TOKENS = 256           # the most tokens a step computes (the runner's and the engine's)


@dataclass
class Completion:
    text: str
    token_ids: list
    prompt_token_ids: list
    finish_reason: str


class LLM:
    """A loaded model with a runner and an engine. `context` caps the tokens per sequence."""

    def __init__(self, model=None, backend="auto", context=None, block_size=16):
        device = open_device(backend)
        self.model = load(model)
        self.tokenizer = self.model.tokenizer
        context = min(context or self.model.context_length, self.model.context_length)
        # (a model's sliding-window layers: one ring, of the window and a prefill chunk)
        ring = ring_for(self.model.window, block_size, 1, STEP_TOKENS, context)
        runner = self.model.runner(device, num_blocks=-(-context // block_size),
                                   block_size=block_size, max_tokens=STEP_TOKENS, ring=ring)
        self.engine = Engine(runner, self.tokenizer, max_seqs=1, step_tokens=STEP_TOKENS,
                             max_context=context)

    def prompt_ids(self, prompt, chat=False):
        """Token ids of a prompt: text (rendered as one user message when chat), or ids."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if chat:
            return self.chat_prompt_ids([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, add_special=True, parse_special=True)

    def chat_prompt_ids(self, messages):
        if self.model.chat_template is None:
            raise TemplateError(f"{self.model.name} has no chat template")
        text = self.model.chat_template.render(messages, add_generation_prompt=True)
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

    def generate(self, prompt, chat=False, **params):
        prompt_ids = self.prompt_ids(prompt, chat)
        return self._collect(prompt_ids, self.outputs(prompt_ids, **params))

    def chat(self, messages, **params):
        prompt_ids = self.chat_prompt_ids(messages)
        return self._collect(prompt_ids, self.outputs(prompt_ids, **params))

    @staticmethod
    def _collect(prompt_ids, outputs):
        text, ids, reason = [], [], None
        for out in outputs:
            text.append(out.text)
            ids += out.token_ids
            reason = out.finish_reason or reason
        return Completion("".join(text), ids, prompt_ids, reason)
