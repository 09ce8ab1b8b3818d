"""A sequence's edits of its own logits: what its penalties, logit_bias and min_tokens make of
its next step's logits, kept up to date token by token.

`LogitControls.of(params, prompt, stop_ids, vocab)` is None for a sequence that has none (it
then costs nothing). Otherwise `accept(token)` counts each token it samples, and
`edits(generated)` gives the next step's (tokens, repeat, add), one entry a token, for
SamplingRows.edits (batch.LogitEdits), which engine/sampling.py's edit_logits defines and the
device runners apply. Per token t, in this order (vLLM's meanings):
- repetition_penalty: t's logit is divided by it where positive, multiplied where not, once t is
  in the prompt or the output (repeat);
- frequency_penalty times t's count in the output, and presence_penalty once t is there, are
  subtracted (add);
- logit_bias[t] is added; a bias of -100 (BAN_BIAS) bans t (add -inf) instead;
- min_tokens bans the end-of-sequence and stop tokens until that many tokens are generated.
The prompt's tokens and the biases are worked out once; a step merges them with the output's
counts.
"""
import numpy as np

BAN_BIAS = -100.0       # a logit_bias this low bans its token (OpenAI: "a ban")


class LogitControls:
    def __init__(self, params, prompt, bans):
        self.repetition = float(params.repetition_penalty)
        self.frequency = float(params.frequency_penalty)
        self.presence = float(params.presence_penalty)
        self.min_tokens = params.min_tokens
        self.bans = np.array(sorted(bans), np.int32)
        self.counts = {}            # output token -> how many times it was sampled
        self.counting = self.repetition != 1 or self.frequency or self.presence
        seen = np.unique(np.asarray(prompt, np.int32)) if self.repetition != 1 \
            else np.zeros(0, np.int32)
        bias = dict(params.logit_bias or {})
        biased = np.array(sorted(bias), np.int32)
        self.ids = np.union1d(seen, biased).astype(np.int32)
        self.repeat = np.where(np.isin(self.ids, seen), self.repetition, 1.0)
        self.add = np.zeros(len(self.ids))
        values = np.array([bias[t] for t in biased.tolist()], np.float64)
        self.add[np.searchsorted(self.ids, biased)] = np.where(values <= BAN_BIAS, -np.inf,
                                                               values)

    @classmethod
    def of(cls, params, prompt, stop_ids, vocab):
        """The controls of a sequence with `params`, `prompt` and end tokens `stop_ids` (its
        end-of-sequence tokens where they end it, and its stop_token_ids), in a vocabulary of
        `vocab` tokens; None where they edit nothing."""
        bans = {t for t in stop_ids if 0 <= t < vocab} if params.min_tokens else set()
        if params.repetition_penalty == 1 and not params.frequency_penalty \
                and not params.presence_penalty and not params.logit_bias and not bans:
            return None
        return cls(params, prompt, bans)

    def accept(self, token):
        """A token the sequence sampled."""
        if self.counting:
            self.counts[token] = self.counts.get(token, 0) + 1

    def edits(self, generated):
        """(tokens int32, repeat float32, add float32) of the next step, `generated` tokens
        sampled so far: every token whose logit changes, once."""
        out = np.fromiter(self.counts, np.int32, len(self.counts))
        count = np.fromiter(self.counts.values(), np.float64, len(self.counts))
        bans = self.bans if generated < self.min_tokens else self.bans[:0]
        ids = np.concatenate([self.ids, out, bans])
        tokens, at = np.unique(ids, return_inverse=True)
        repeated = np.concatenate([self.repeat != 1, np.full(len(out), self.repetition != 1),
                                   np.zeros(len(bans), bool)])
        repeat = np.where(np.bincount(at, repeated, len(tokens)) > 0, self.repetition, 1.0)
        add = np.bincount(at, np.concatenate([self.add, -self.frequency * count - self.presence,
                                              np.full(len(bans), -np.inf)]), len(tokens))
        edit = (repeat != 1) | (add != 0)
        return (tokens[edit].astype(np.int32), repeat[edit].astype(np.float32),
                add[edit].astype(np.float32))
