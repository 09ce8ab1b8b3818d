"""A sequence's penalties, logit_bias and min_tokens as edits of its logits, against vLLM's
formulas written out over a whole row."""
import numpy as np

from poot.engine.batch import LogitEdits, SamplingRows
from poot.engine.logit_controls import LogitControls
from poot.engine.request import SamplingParams
from poot.engine.sampling import BANNED, edit_logits

V = 500


def edited(controls, logits, generated):
    rows = SamplingRows.greedy(1)
    rows.edits = LogitEdits.of(1, {0: controls.edits(generated)})
    return edit_logits(logits[None], rows)[0]


def vllm(logits, prompt, output, params, ends):
    """vLLM's penalties (repetition over prompt and output, frequency and presence over the
    output), then the bias, -100 a ban, then min_tokens' bans, over the whole row."""
    x = logits.astype(np.float32).copy()
    seen = np.zeros(V, bool)
    seen[list(prompt) + list(output)] = True
    rep = np.float32(params.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x).astype(np.float32)
    counts = np.bincount(np.array(output, int), minlength=V)
    x = x - np.float32(params.frequency_penalty) * counts.astype(np.float32) \
        - np.float32(params.presence_penalty) * (counts > 0)
    for t, b in (params.logit_bias or {}).items():
        x[t] = BANNED if b <= -100 else x[t] + np.float32(b)
    if len(output) < params.min_tokens:
        x[list(ends)] = BANNED
    return x


def test_a_sequence_without_controls_has_none():
    assert LogitControls.of(SamplingParams(), [1, 2, 3], (0,), V) is None
    assert LogitControls.of(SamplingParams(stop_token_ids=(4,)), [1], (0, 4), V) is None


def test_edits_follow_vllms_penalties_bias_and_min_tokens_token_by_token():
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, V, 60).tolist()
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.3, min_tokens=4, stop_token_ids=(7, 9999),
                            logit_bias={11: 5.0, 12: -100.0, prompt[0]: -2.0})
    ends = (2, 7, 9999)                     # 9999 lies past the vocabulary: never banned
    controls = LogitControls.of(params, prompt, ends, V)
    output = []
    for step in range(8):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        got = edited(controls, logits, len(output))
        want = vllm(logits, prompt, output, params, ends[:2])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert (got[[2, 7]] == BANNED).all() == (step < 4) and got[12] == BANNED
        token = int(rng.choice(prompt[:5] + [11, 30, 31]))
        controls.accept(token)
        output.append(token)


def test_each_token_is_edited_once_and_untouched_tokens_are_left_out():
    params = SamplingParams(frequency_penalty=1.0, logit_bias={3: 0.0, 5: 1.0})
    controls = LogitControls.of(params, [1, 2, 3], (), V)
    for token in (5, 5, 8):
        controls.accept(token)
    tokens, repeat, add = controls.edits(3)
    assert tokens.tolist() == [5, 8] and repeat.tolist() == [1, 1]
    assert add.tolist() == [1.0 - 2.0, -1.0]        # the bias and twice the penalty
