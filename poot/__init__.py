"""poot: LLM inference and an OpenAI-compatible server on the vendors' own GPU drivers.

    import poot
    llm = poot.LLM("model.gguf")          # or poot.LLM() for the default model
    llm.generate("The capital of France is", max_tokens=8, temperature=0).text

`poot.load(path)` opens a model file (GGUF or a Hugging Face folder) without a runner: its
config, tokenizer and chat template. Errors a caller can act on are `poot.PootError`s.
"""
from .errors import (BackendUnavailable, CapacityError, ModelFileError, ModelRefused,
                     PlacementRefused, PootError, TemplateError, UsageError)
from .llm import LLM, Completion
from .loader import LoadedModel, default_model_path, load

__all__ = ["LLM", "Completion", "LoadedModel", "load", "default_model_path", "PootError",
           "UsageError", "BackendUnavailable", "ModelRefused", "PlacementRefused",
           "CapacityError", "ModelFileError", "TemplateError"]
