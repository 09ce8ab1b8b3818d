"""Loading a model: the file, its config, its tokenizer and chat template, and its step graph.

`load(path)` checks everything it can before any device sees the model: the file's structure
(formats/), the architecture and config (models/), every weight's presence and shape, the
tokenizer. A model that loads here fails later only for reasons of the device.
"""
import os
from pathlib import Path

import numpy as np

from .errors import ModelFileError
from .formats import open_model
from .models import MissingWeight, WrongShape, gguf_family, hf_family
from .text.chat import ChatTemplate
from .text.tokenizer import Tokenizer

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir():
    """Where poot keeps fetched models: $POOT_CACHE, else $XDG_CACHE_HOME/poot, else ~/.cache/poot."""
    if os.environ.get("POOT_CACHE"):
        return Path(os.environ["POOT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "poot"


def default_model_path():
    return cache_dir() / "models" / DEFAULT_MODEL_FILE


class LoadedModel:
    """A model file, understood: config, tokenizer, chat template, and its weights by GGUF name.
    `weights=False`: its text side alone (tokenizer, chat template, name), which a file holding
    only a vocabulary, or an architecture poot does not run, has too."""

    def __init__(self, path, weights=True):
        self.path = Path(path)
        self.file = open_model(self.path)
        if self.file.kind == "gguf":
            meta = self.file.metadata
            self.tokenizer = Tokenizer.from_gguf(meta)
            template = meta.get("tokenizer.chat_template")
            self.name = self.path.name.removesuffix(".gguf")
        else:
            self.tokenizer = Tokenizer.from_hf(self.file.tokenizer_json or {},
                                               self.file.tokenizer_config,
                                               self.file.generation_config)
            template = hf_chat_template(self.path, self.file.tokenizer_config)
            self.name = self.path.name
        self.chat_template = template and ChatTemplate(
            template, bos_token=self._token_text(self.tokenizer.bos_id),
            eos_token=self._token_text(min(self.tokenizer.eos_ids, default=None)))
        # the token that ends a turn of the family's chat format ends generation (a family's
        # optional END_OF_TURN), as llama.cpp ends generation on such tokens by their text; a
        # vocabulary alone may name no family
        try:
            family = (gguf_family(self.path, self.file.metadata) if self.file.kind == "gguf"
                      else hf_family(self.path, self.file.config or {}))
        except ModelFileError:
            family = None
        ends = {self.tokenizer.token_to_id(t) for t in getattr(family, "END_OF_TURN", ())}
        self.tokenizer.eos_ids = self.tokenizer.eos_ids | (ends - {None})
        if weights:
            self._read_weights()

    def _read_weights(self):
        """The family, its config and the weights' GGUF names; then the step graph, so that
        every weight is present with the shape the config implies."""
        if self.file.kind == "gguf":
            self._file_names = {name: name for name in self.file.tensors}
            self.family = gguf_family(self.path, self.file.metadata)
            self.config = self.family.config_from_gguf(self.path, self.file.metadata,
                                                       self._file_names)
        else:
            self.family = hf_family(self.path, self.file.config)
            self._file_names = hf_weight_names(self.path, self.family, self.file.tensors)
            self.config = self.family.config_from_hf(self.path, self.file.config)
        # the rope's per-pair frequency divisors, where the file holds them as a tensor:
        # Llama 3.1's rope_freqs, or the one of LongRoPE's pair its family's config chose
        factors = getattr(self.config, "rope_factors_tensor", None) or "rope_freqs.weight"
        self.freq_factors = (self.file.array(self._file_names[factors])
                             if factors in self._file_names else None)
        self.context_length = self.config.context_length
        self.step_graph(num_blocks=1, block_size=1)

    def _token_text(self, token):
        return "" if token is None else self.tokenizer.token_bytes(token).decode("utf-8", "replace")

    def weight_shapes(self):
        """GGUF name -> (shape, storage dtype) of every weight the file holds."""
        out = {}
        for name, file_name in self._file_names.items():
            if isinstance(file_name, tuple):        # stacked: one tensor per row
                t = self.file.tensors[file_name[0]]
                out[name] = ((len(file_name),) + tuple(t.shape), t.dtype)
            else:
                out[name] = (self.file.tensors[file_name].shape, self.file.tensors[file_name].dtype)
        return out

    def weight_array(self, name):
        """A weight dequantised to float32 (the reference interpreter's view of it), with the
        values a GGUF file would hold (a family's hf_array: Gemma's norms as 1 + w); a stacked
        one's parts stacked."""
        file_name = self._file_names[name]
        if isinstance(file_name, tuple):
            return np.stack([self.file.array(n) for n in file_name])
        array = self.file.array(file_name)
        as_gguf = getattr(self.family, "hf_array", None)
        return array if self.file.kind == "gguf" or as_gguf is None else as_gguf(name, array)

    def weight_raw(self, name):
        """A weight's stored bytes (a stacked one's: its parts' one after another)."""
        file_name = self._file_names[name]
        if isinstance(file_name, tuple):
            return np.concatenate([self.file.raw(n) for n in file_name])
        return self.file.raw(file_name)

    def embedding(self, last_hidden):
        """A prompt's embedding (unit length) from its last token's final hidden state."""
        if not hasattr(self, "_small_weights"):
            self._small_weights = {}

        def weight(name):                   # the few small weights an embedding reads, kept
            if name not in self._small_weights:
                self._small_weights[name] = self.weight_array(name)
            return self._small_weights[name]
        return self.family.embedding(self.config, weight, last_hidden)

    @property
    def window(self):
        """The positions its sliding-window layers attend to (0: it has none)."""
        cfg = self.config
        return cfg.sliding_window if any(getattr(cfg, "sliding", ())) else 0

    def step_graph(self, num_blocks, block_size, part=None, ring_blocks=0):
        """The step graph; `part` (engine/placement.py) makes one device's part of a group;
        `ring_blocks` > 0: its window layers' caches hold that many blocks (kvcache.Ring)."""
        ring = {"ring_blocks": ring_blocks} if ring_blocks else {}
        try:
            return self.family.forward(self.config, self.weight_shapes(), num_blocks,
                                       block_size, self.freq_factors, part, **ring)
        except MissingWeight as e:
            raise ModelFileError(self.path, f"tensor {e.name} is missing", tensor=e.name) from None
        except WrongShape as e:
            raise ModelFileError(self.path, str(e), tensor=e.name) from None

    def runner(self, device=None, num_blocks=None, block_size=16, max_tokens=256, max_seqs=16,
               ring=None):
        """A runner for this model: the numpy reference when `device` is None, else a
        DeviceRunner on that device (backends/select.py opens devices), allocated and uploaded;
        `ring` (kvcache.Ring): its window layers' cache."""
        from .engine.device_runner import DeviceRunner
        from .engine.runner import ReferenceRunner
        if num_blocks is None:
            num_blocks = -(-self.context_length // block_size)
        if device is None:
            return ReferenceRunner(self, num_blocks, block_size, ring)
        runner = DeviceRunner(self, device, num_blocks, block_size, max_tokens, max_seqs,
                              ring=ring)
        runner.allocate()
        runner.upload()
        return runner

    def close(self):
        self.file.close()


def hf_weight_names(path, family, tensors):
    """GGUF name -> the Hugging Face tensor of each weight the family reads, or for a stacked
    one (a layer's experts) the tuple of its parts in order, which must be complete and alike."""
    names, stacked = {}, {}
    for file_name in tensors:
        name = family.gguf_name(file_name)
        if isinstance(name, tuple):
            stacked.setdefault(name[0], {})[name[1]] = file_name
        elif name:
            names[name] = file_name
    for name, parts in stacked.items():
        if sorted(parts) != list(range(len(parts))):
            missing = min(set(range(max(parts) + 1)) - set(parts))
            raise ModelFileError(path, f"{name} lacks its part {missing}", tensor=name)
        names[name] = tuple(parts[i] for i in range(len(parts)))
        kinds = {(tuple(tensors[n].shape), tensors[n].dtype) for n in names[name]}
        if len(kinds) != 1:
            raise ModelFileError(path, f"the parts of {name} differ in shape or dtype: "
                                       f"{sorted(kinds)}", tensor=names[name][0])
    return names


def hf_chat_template(path, tokenizer_config):
    """The chat template of a Hugging Face folder: chat_template.jinja, else tokenizer_config's."""
    jinja_file = Path(path) / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, list):          # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load(path=None, weights=True):
    """Opens a model file (GGUF) or Hugging Face folder; the default model when path is None.
    weights=False reads its tokenizer and chat template alone (LoadedModel)."""
    return LoadedModel(path or default_model_path(), weights)
