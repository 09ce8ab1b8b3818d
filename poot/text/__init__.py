"""Text: tokenizers (byte-level and SentencePiece BPE) and chat templates."""

from poot.text.pretokenize import TokenizerUnsupported
from poot.text.tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["IncrementalDecoder", "Tokenizer", "TokenizerUnsupported"]
