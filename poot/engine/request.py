"""One generation request as the engine sees it: its parameters, its sequence state, its outputs.

`SamplingParams` is what a caller asks for; `Sequence` is the engine's state of one choice of a
request (tokens, KV blocks, text decoding, stop checks); `Fork` ties the n choices of one prompt;
`Output` is what the caller receives after each step. `StopText` holds back text that may be the
start of a stop string. No scheduling and no JSON here: the scheduler moves sequences, the server
shapes outputs.
"""
import secrets
from dataclasses import dataclass, field

from poot.errors import PootError

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 512            # a stop string's length bounds the text held back each token
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_N = 16                      # choices of one prompt
MAX_CHOICES = 1024              # choices of one request: its prompts times n
MAX_LOGIT_BIAS = 1024           # tokens one request may bias


class InvalidRequest(ValueError):
    """A request the engine cannot run as asked; `param` names the offending parameter."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


class EngineFailed(PootError):
    """A step raised: every request in flight at that moment ends with this error."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop.

    temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 switch those cuts off. max_tokens None
    means "until the context is full"; 0 generates nothing (the prompt is computed for its
    prompt_logprobs). seed None draws a fresh random seed per request.
    logprobs None reports no log probabilities; an int n reports the chosen token's and the
    n most likely alternatives (0..20). prompt_logprobs, the same for each prompt token after
    the first: its log probability after the tokens before it (vLLM's field of that name).
    skip_special_tokens leaves control tokens out of the text (as vLLM's field of that name).

    presence_penalty and frequency_penalty (OpenAI's, -2..2), repetition_penalty (vLLM's, > 0;
    1 is none), logit_bias ({token id: -100..100}; -100 bans the token) and min_tokens (the
    end-of-sequence and stop_token_ids are banned until that many tokens are generated) edit
    the logits before sampling: engine/logit_controls.py says how.

    constraint, where given, limits what may be sampled: an object whose `start()` gives each
    sequence its own state, with `allowed()` (a packed bitmask of the vocabulary: bit t % 32 of
    uint32 word t // 32 set where token t may come next; end-of-sequence tokens included where
    the sequence may end) and `advance(token)` (raises where the token was not allowed), and
    optionally `ready()` (whether allowed() answers at once: engine/masks.py).
    poot.grammar's TokenGrammar is one.

    embed asks for the prompt's last hidden state instead of new tokens (with max_tokens 0):
    the request ends when its prompt is computed, its one Output carrying `hidden`.
    """
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    constraint: object = None
    embed: bool = False
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    min_tokens: int = 0

    def __post_init__(self):
        def bad(param, message):
            raise InvalidRequest(message, param)

        if self.max_tokens is not None and not 0 <= self.max_tokens:
            bad("max_tokens", f"max_tokens must be at least 0, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be between 0 and 1, got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:
            bad("seed", f"seed must be between 0 and 2**64 - 1, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            bad("stop", f"a stop string holds at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got "
                f"{len(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                bad(name, f"{name} must be between 0 and {MAX_LOGPROBS}, got {n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            bad("repetition_penalty", "repetition_penalty must be a positive number, got "
                f"{self.repetition_penalty}")
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for token, value in bias.items():
            if not isinstance(token, int) or token < 0:
                bad("logit_bias", f"logit_bias keys must be token ids, got {token!r:.40}")
            if not -100.0 <= value <= 100.0:
                bad("logit_bias", f"logit_bias values must be between -100 and 100, got {value} "
                    f"for token {token}")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be 0 or more, got {self.min_tokens}")
        if self.min_tokens and self.constraint is not None:
            bad("min_tokens", "min_tokens together with a constraint (response_format, forced "
                "tool calls, guided_regex) is not supported: the grammar decides where the "
                "output may end")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_tokens})")


@dataclass
class TokenLogprob:
    """The chosen token's log probability and the top alternatives as (token id, logprob); for a
    prompt token, the token itself."""
    token_id: int
    logprob: float
    top: list


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0      # prompt tokens whose keys and values came from the prefix cache

    @property
    def total_tokens(self):
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Output:
    """What one step gave one request.

    token_ids: the tokens sampled this step (counted in usage even when they are eos or a stop
    token); text: the newly final text (possibly empty while held back); logprobs: one entry per
    token whose text is emitted, when asked; elapsed: seconds since the previous token (since
    submission for the first); finish_reason "stop", "length" or "abort" with usage on the last.
    index: whose (prompt i's choice j of a request of n choices a prompt is i * n + j).
    prompt_logprobs: on a choice's first Output where SamplingParams.prompt_logprobs asks, an
    entry for each prompt token after the first.
    """
    token_ids: list
    text: str
    logprobs: list | None = None
    elapsed: float | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    hidden: object = None       # float32 [d_model]: the prompt's last hidden state (embed)
    index: int = 0
    prompt_logprobs: list | None = None


class StopText:
    """Incremental text with stop strings: emits what can no longer be part of a stop string."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.pending = ""
        # by character, the lengths of the stops' proper prefixes that end in it, longest
        # first: the only held-back suffixes worth testing after text that ends in it
        ends = {}
        for stop in self.stops:
            for k in range(1, len(stop)):
                ends.setdefault(stop[k - 1], set()).add(k)
        self._ends = {c: sorted(ks, reverse=True) for c, ks in ends.items()}

    def push(self, piece, armed=True):
        """Add text; return (text now final, whether a stop string was found). Not `armed`
        (within min_tokens) no stop string is looked for, but the text that may start one is
        still held back: one that ends after the arming is found then."""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0] if armed else []
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = self._held_suffix()
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self):
        out, self.pending = self.pending, ""
        return out

    def _held_suffix(self):
        """Length of the longest suffix of pending that is a proper prefix of a stop string."""
        for k in self._ends.get(self.pending[-1:], ()):
            if k <= len(self.pending):
                tail = self.pending[-k:]
                if any(s.startswith(tail) for s in self.stops):
                    return k
        return 0


@dataclass(eq=False)
class Sequence:
    """The engine's state of one choice of a request.

    tokens holds the prompt then every sampled token; num_computed counts the leading tokens whose
    keys/values are in the KV cache. A preempted sequence drops its blocks and sets num_computed
    to 0: the next prefill recomputes prompt and generated tokens alike, and sampling resumes at
    step len(generated), so the random draws (a function of seed and step) are the same.
    A sequence that reports its prompt's log probabilities (the first of its fork, or alone)
    scores each prompt position it computes (logprob_positions) until it knows them all.
    """
    seq_id: int
    prompt: list
    params: SamplingParams
    max_tokens: int
    seed: int
    decoder: object
    eos_ids: frozenset
    tokens: list = field(init=False)
    stop_text: StopText = field(init=False)
    num_computed: int = 0
    blocks: list = field(default_factory=list)
    ring: int | None = None # its window layers' ring while it runs (kvcache.Ring), if any
    lane: int = 0           # the runner's lane whose steps run it (engine/scheduler.py)
    keys: list = field(default_factory=list)    # prefix keys of its full blocks (kvcache.py)
    cached_tokens: int = 0  # of its prompt, taken from the prefix cache when first admitted
    admitted: bool = False
    constraint: object = None   # params.constraint's state for this sequence
    controls: object = None     # its LogitControls (engine/logit_controls.py), if any
    last_token_time: float | None = None
    finish_reason: str | None = None
    index: int = 0              # Output.index
    fork: object = None         # the Fork of its prompt's choices, where n > 1
    prompt_logprobs: list = field(default_factory=list)    # by position from 1, as computed
    prompt_reported: bool = False

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.stop_text = StopText(self.params.stop)
        if self.params.constraint is not None:
            self.constraint = self.params.constraint.start()

    @classmethod
    def create(cls, seq_id, prompt, params, max_tokens, tokenizer, seed=None, index=0):
        """`seed` None: params.seed, or a fresh random one where that is None too."""
        if seed is None:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        return cls(seq_id=seq_id, prompt=list(prompt), params=params, max_tokens=max_tokens,
                   seed=seed, decoder=tokenizer.decoder(skip_special=params.skip_special_tokens),
                   eos_ids=frozenset(tokenizer.eos_ids), index=index)

    @property
    def num_generated(self):
        return len(self.tokens) - len(self.prompt)

    @property
    def num_uncomputed(self):
        return len(self.tokens) - self.num_computed

    @property
    def waits_for_fork(self):
        """A choice after its fork's first, while the first has not computed the prompt yet
        (and still may)."""
        fork = self.fork
        return (fork is not None and fork.first is not self and not fork.primed
                and fork.first.finish_reason is None)

    def logprob_positions(self, start, n):
        """The positions among [start, start + n) whose next prompt token's log probability
        the sequence reports and does not know yet (a row each, forced to that token)."""
        if self.params.prompt_logprobs is None or (self.fork is not None
                                                    and self.fork.first is not self):
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(start + n, len(self.prompt) - 1))

    def samples_after(self, start, n):
        """Whether computing [start, start + n) ends with a row that samples the next token."""
        return start + n == len(self.tokens) and (self.max_tokens > 0 or self.params.embed)

    def rows(self, start, n):
        """How many rows of its step computing [start, start + n) takes."""
        return len(self.logprob_positions(start, n)) + self.samples_after(start, n)

    def usage(self):
        return Usage(len(self.prompt), self.num_generated, self.cached_tokens)

    def _prompt_logprobs_once(self):
        """The prompt's log probabilities for the first Output, where they are asked (a fork's
        other choices report the first's)."""
        if self.params.prompt_logprobs is None or self.prompt_reported:
            return None
        self.prompt_reported = True
        return list((self if self.fork is None else self.fork.first).prompt_logprobs)

    def take(self, token_id, context_limit):
        """Append a sampled token and check the stops a token alone decides (a stop token, the
        end of sequence, max_tokens, the context): all the next step needs, so the engine can
        launch it before this token's text is decoded (emit)."""
        self.tokens.append(token_id)
        if self.controls is not None:
            self.controls.accept(token_id)
        if token_id in self.params.stop_token_ids \
                or (token_id in self.eos_ids and not self.params.ignore_eos):
            self.finish_reason = "stop"
        elif self.num_generated >= self.max_tokens or len(self.tokens) >= context_limit:
            self.finish_reason = "length"

    def emit(self, logprob, now):
        """The Output of the token take() appended: its text (a stop string in it finishes
        the sequence "stop", and cuts the text there), its log probability, the time since
        the previous token."""
        token_id = self.tokens[-1]
        elapsed = now - self.last_token_time
        self.last_token_time = now
        stop_token = self.finish_reason == "stop"
        if stop_token:
            # Held-back text was waiting to see if it starts a stop string; now it is final.
            text = self._flush_text()
        else:
            # vLLM's min_tokens: no stop string ends a reply before that many tokens
            text, hit = self.stop_text.push(self.decoder.push(token_id),
                                            self.num_generated >= self.params.min_tokens)
            if hit:
                self.finish_reason = "stop"
            elif self.finish_reason == "length":
                text += self._flush_text()
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = [] if stop_token else [logprob]
        return Output(token_ids=[token_id], text=text, logprobs=logprobs, elapsed=elapsed,
                      finish_reason=self.finish_reason,
                      usage=self.usage() if self.finish_reason else None, index=self.index,
                      prompt_logprobs=self._prompt_logprobs_once())

    def end_at_prompt(self):
        """The Output of a sequence of max_tokens 0 once its prompt is computed (or at once,
        where it reports nothing of it)."""
        self.finish_reason = "length"
        return Output(token_ids=[], text="", finish_reason="length", usage=self.usage(),
                      index=self.index, prompt_logprobs=self._prompt_logprobs_once())

    def _flush_text(self):
        """The held-back text at a finish that is not a stop string; a stop string in the
        decoder's last bytes still cuts it and turns the finish into "stop"."""
        text, hit = self.stop_text.push(self.decoder.flush())
        if hit:
            self.finish_reason = "stop"
            return text
        return text + self.stop_text.flush()

    def embedded(self, hidden):
        """The Output of an embed request whose prompt is computed."""
        self.finish_reason = "stop"
        return Output(token_ids=[], text="", finish_reason="stop", usage=self.usage(),
                      hidden=hidden, index=self.index)

    def abort(self):
        self.finish_reason = "abort"
        return Output(token_ids=[], text="", finish_reason="abort", usage=self.usage(),
                      index=self.index)


@dataclass(eq=False)
class Fork:
    """The n choices of one prompt (n > 1): the first computes the prompt; the others wait until
    it has (`primed`), then take its full blocks and compute only the rest (scheduler.py).

    `waiting` counts the others not admitted yet; `blocks` are the prompt's full blocks, held for
    them from the moment the first has computed the prompt until the last of them is admitted
    (or blocks run short: they then compute the prompt themselves)."""
    first: Sequence
    waiting: int
    blocks: list = field(default_factory=list)
    primed: bool = False
