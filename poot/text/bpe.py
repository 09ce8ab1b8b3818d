"""BPE word encoders: one pre-tokenized word in, token ids out.

Two vocabularies share one merge loop. Byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2) spells
every byte as a printable character and merges by the rank of the pair in the merge list.
SentencePiece BPE (Llama 2, Mistral, Gemma 4) merges characters, by the score of the merged piece
or by merge rank, and spells characters missing from the vocabulary as
`<0xXX>` byte tokens. Not here: how text is cut into words (pretokenize.py), special tokens and
BOS/EOS (tokenizer.py).
"""

import functools
import heapq


def _byte_chars():
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the rest are
    numbered upwards from U+0100 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


BYTE_CHARS = _byte_chars()
CHAR_BYTES = {c: b for b, c in enumerate(BYTE_CHARS)}
_BYTES_TO_CHARS = {b: ord(c) for b, c in enumerate(BYTE_CHARS)}


def byte_level_text(data: bytes) -> str:
    """The byte-level spelling of raw bytes (b' the' -> 'Ġthe')."""
    return data.decode("latin-1").translate(_BYTES_TO_CHARS)


def byte_level_bytes(text: str) -> bytes:
    """The raw bytes of a byte-level token; characters outside the table stand for their UTF-8."""
    if all(c in CHAR_BYTES for c in text):
        return bytes(CHAR_BYTES[c] for c in text)
    return text.encode("utf-8", "surrogateescape")


def merge(symbols, rank):
    """Merge adjacent symbols, lowest `rank(left, right)` first and leftmost on ties, until no
    pair has a rank. Symbols live in a linked list and candidate pairs in a heap; a heap entry is
    stale once either side has grown, which string equality detects since symbols only grow."""
    n = len(symbols)
    if n < 2:
        return list(symbols)
    sym, nxt, prv = list(symbols), list(range(1, n + 1)), list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        r = rank(sym[i], sym[i + 1])
        if r is not None:
            heap.append((r, i, sym[i], sym[i + 1]))
    heapq.heapify(heap)
    while heap:
        _, i, left, right = heapq.heappop(heap)
        j = nxt[i]
        if sym[i] != left or j >= n or sym[j] != right:
            continue
        sym[i], sym[j] = left + right, None
        nxt[i] = nxt[j]
        if nxt[j] < n:
            prv[nxt[j]] = i
        p, k = prv[i], nxt[i]
        if p >= 0:
            r = rank(sym[p], sym[i])
            if r is not None:
                heapq.heappush(heap, (r, p, sym[p], sym[i]))
        if k < n:
            r = rank(sym[i], sym[k])
            if r is not None:
                heapq.heappush(heap, (r, i, sym[i], sym[k]))
    return [s for s in sym if s is not None]


def parse_merges(merges):
    """{(left, right): rank} from 'left right' strings or [left, right] pairs."""
    ranks = {}
    for rank, m in enumerate(merges):
        pair = tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
        if len(pair) != 2:
            raise ValueError(f"merge {m!r} is not a pair")
        ranks.setdefault(pair, rank)
    return ranks


class ByteLevelBPE:
    """Byte-level BPE over `vocab` ({byte-level token text: id}) and `merges` ({pair: rank}).

    With `ignore_merges` (Llama 3) a word that is itself a token is taken whole. A byte with no
    token of its own (SmolLM2 has none for 0x04, for instance) cannot be written in this
    vocabulary and is dropped, as Hugging Face's BPE without an unknown token drops it."""

    def __init__(self, vocab, merges, ignore_merges=False, cache_size=1 << 16):
        self.vocab, self.merges, self.ignore_merges = vocab, merges, ignore_merges
        self.encode_word = functools.lru_cache(maxsize=cache_size)(self._encode_word)

    def _rank(self, left, right):
        return self.merges.get((left, right))

    def _encode_word(self, word: str) -> tuple:
        """The ids of one word, spelled byte-level already (the pre-tokenizer's last step)."""
        vocab = self.vocab
        if self.ignore_merges and word in vocab:
            return (vocab[word],)
        return tuple(vocab[s] for s in merge(word, self._rank) if s in vocab)


class SentencePieceBPE:
    """SentencePiece BPE over `vocab` ({piece: id}, spaces already spelled '▁').

    Merge priority is either `scores` ({piece: score}, higher first: the Llama GGUF form) or
    `merges` ({pair: rank}: the tokenizer.json and Gemma 4 GGUF form). A character with no piece
    becomes its UTF-8 bytes as `<0xXX>` tokens when `byte_ids` has them, else `unk_id` (runs
    fused if `fuse_unk`). With `whole_newlines` (Gemma 4, whose merges never build its tokens
    for runs of newlines) a word of newlines alone that is a token is taken whole."""

    def __init__(self, vocab, *, scores=None, merges=None, byte_ids=None, unk_id=None,
                 fuse_unk=False, whole_newlines=False, cache_size=1 << 16):
        self.vocab, self.byte_ids, self.unk_id, self.fuse_unk = vocab, byte_ids, unk_id, fuse_unk
        self.whole_newlines = whole_newlines
        if merges is not None:
            self._rank = lambda left, right: merges.get((left, right))
        else:
            ranks = {piece: -score for piece, score in scores.items()}
            self._rank = lambda left, right: ranks.get(left + right)
        self.encode_word = functools.lru_cache(maxsize=cache_size)(self._encode_word)

    def _encode_word(self, word: str) -> tuple:
        if self.whole_newlines and word in self.vocab and not word.strip("\n"):
            return (self.vocab[word],)
        ids = []
        for piece in merge(word, self._rank):
            if piece in self.vocab:
                ids.append(self.vocab[piece])
            elif self.byte_ids is not None:
                ids.extend(self.byte_ids[b] for b in piece.encode("utf-8"))
            elif self.unk_id is None:
                raise ValueError(f"no token for {piece!r} and no unknown token")
            elif not (self.fuse_unk and ids and ids[-1] == self.unk_id):
                ids.append(self.unk_id)
        return tuple(ids)
