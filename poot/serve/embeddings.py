"""/v1/embeddings: OpenAI's request and response around the engine's embed requests.

Each input (a string, or a list of token ids) is one engine request with `embed` set: its
prompt is computed beside the generating requests, in the same steps, and its embedding is the
model's (Model.embedding: the last token's final hidden state, normed, unit length).
`dimensions` keeps the first that many values and scales them to unit length again (as
OpenAI's shortened embeddings); `encoding_format` "base64" sends the float32 values' bytes,
little-endian, in base64.
"""
import base64

import numpy as np

from poot.engine.request import SamplingParams
from poot.serve.errors import invalid
from poot.serve.openai import _check_text, _get, check_model

MAX_INPUTS = 2048           # OpenAI's limit on inputs in one request


class Embeddings:
    """One validated /v1/embeddings request."""

    params = SamplingParams(max_tokens=0, temperature=0.0, embed=True)

    def __init__(self, body, model, names):
        self.name = check_model(body, names)
        self.model = model
        self.inputs = _inputs(body.get("input"), model.tokenizer)
        self.base64 = _get(body, "encoding_format", "str", "float") == "base64"
        if body.get("encoding_format") not in (None, "float", "base64"):
            raise invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        size = model.config.d_model
        self.dimensions = _get(body, "dimensions", "int", size)
        if not 1 <= self.dimensions <= size:
            raise invalid(f"'dimensions' must be between 1 and {size} (the model's "
                          f"embedding size), got {self.dimensions}", "dimensions")
        _get(body, "user", "str")

    def response(self, outputs):
        """The response from each input's Output, in input order."""
        data = []
        for index, output in enumerate(outputs):
            vector = self.model.embedding(output.hidden)[:self.dimensions]
            if self.dimensions < len(output.hidden):
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
            vector = np.asarray(vector, "<f4")
            data.append({"object": "embedding", "index": index,
                         "embedding": base64.b64encode(vector.tobytes()).decode()
                         if self.base64 else vector.tolist()})
        tokens = sum(o.usage.prompt_tokens for o in outputs)
        return {"object": "list", "data": data, "model": self.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _inputs(value, tokenizer):
    """The token ids of each input: a string, a list of strings, a list of token ids or a list
    of lists of token ids."""
    def ids(x):
        return isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)
    if isinstance(value, str) or ids(value):
        value = [value]
    if not isinstance(value, list) or not value or not all(
            isinstance(x, str) or ids(x) for x in value):
        raise invalid("'input' must be a non-empty string, an array of them, an array of token "
                      "ids or an array of arrays of token ids", "input")
    if len(value) > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS} inputs in one request, got {len(value)}", "input")
    out = []
    for x in value:
        if isinstance(x, str):
            if not x:
                raise invalid("'input' cannot hold an empty string", "input")
            x = tokenizer.encode(_check_text(x, "input"), add_special=True, parse_special=True)
        out.append(list(x))
    return out
