"""Byte-level BPE tokenizer: a thin wrapper over the `tokenizers` library.

Byte-level means every string round-trips exactly (`decode(encode(s)) == s`), with no unknown
tokens. Special tokens take ids 0..3 in the order (pad, bos, eos, unk). Text that happens to
contain "<eos>" is encoded as ordinary bytes, never as the special token. The tokenizer is stored
as the library's own JSON (tokenizer.json), never pickled, and can be embedded in checkpoint
metadata with `to_json_str()`.
"""

from __future__ import annotations

import hashlib
import numbers
import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from tformer.config import MAX_BPE_VOCAB
from tformer.schema import require_bool

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


class Tokenizer:
    """Encode text to token ids and back. Build with `train_bpe`, `load` or `from_json_str`."""

    def __init__(self, backend: _Backend):
        specials = sorted(
            (t for t in backend.get_added_tokens_decoder().items() if t[1].special), key=lambda t: t[0]
        )
        if len(specials) < 4 or [i for i, _ in specials[:4]] != [0, 1, 2, 3]:
            raise ValueError(
                "tokenizer needs 4 special tokens with ids 0..3 in the order (pad, bos, eos, unk)"
            )
        backend.encode_special_tokens = True  # literal "<eos>" in text stays text (not serialised: set here)
        self._backend = backend
        self.special_tokens = tuple(token.content for _, token in specials[:4])

    @classmethod
    def train_bpe(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        special_tokens: Sequence[str] = SPECIAL_TOKENS,
        min_frequency: int = 2,
    ) -> Tokenizer:
        """Train byte-level BPE on `texts`; deterministic (same texts and settings -> same vocabulary).

        The vocabulary may come out smaller than `vocab_size` when the texts run out of merges.
        """
        if (
            isinstance(special_tokens, str)
            or len(special_tokens) != 4
            or not all(isinstance(t, str) and t for t in special_tokens)
        ):
            raise ValueError(f"special_tokens must be 4 strings (pad, bos, eos, unk), got {special_tokens!r}")
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        twice = next((t for i, t in enumerate(special_tokens) if t in special_tokens[:i]), None)
        if twice is not None:  # one token cannot hold two of the ids 0..3
            raise ValueError(f"special_tokens name {twice!r} twice; the 4 (pad, bos, eos, unk) must differ")
        byte = next((t for t in special_tokens if t in alphabet), None)
        if byte is not None:  # the byte-level alphabet's own token: text holding that byte would lose it
            raise ValueError(
                f"special token {byte!r} is a character of the byte-level alphabet (a token every "
                "vocabulary has for one byte); choose a longer one, such as '<pad>'"
            )
        if (
            isinstance(min_frequency, bool)
            or not isinstance(min_frequency, numbers.Integral)
            or min_frequency < 0
        ):
            raise ValueError(f"min_frequency must be an int >= 0, got {min_frequency!r}")
        texts = [t for t in _texts(texts) if t.strip()]
        if not texts:
            raise ValueError("no text to train a tokenizer on (every text is empty)")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
            raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
        vocab_size = int(vocab_size)
        if vocab_size < len(alphabet) + len(special_tokens):
            raise ValueError(f"vocab_size {vocab_size} < 256 bytes + {len(special_tokens)} special tokens")
        if vocab_size > MAX_BPE_VOCAB:  # the library would try to allocate for it and abort the process
            raise ValueError(
                f"vocab_size {vocab_size:,} is above the {MAX_BPE_VOCAB:,} a BPE vocabulary may have here"
            )
        backend = _Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(special_tokens),
            initial_alphabet=alphabet,
            show_progress=False,
        )
        backend.train_from_iterator(_pieces(texts), trainer=trainer)
        return cls(backend)

    # ------------------------------------------------------------ ids

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def unk_id(self) -> int:
        return 3

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, None for a string that is not one of the vocabulary's tokens."""
        if not isinstance(token, str):
            raise TypeError(f"token must be a str (id_to_token turns an id into one), got {type(token).__name__}")  # fmt: skip
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token of an id, None for an id outside the vocabulary."""
        token_id = _token_id(token_id, "token_id")
        return self._backend.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None

    # ------------------------------------------------------------ encode / decode

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        require_bool(add_bos=add_bos, add_eos=add_eos)
        (text,) = _texts([text], "text")
        return self._wrap(self._backend.encode(text, add_special_tokens=False).ids, add_bos, add_eos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        """Encode many texts at once (parallel in the library)."""
        require_bool(add_bos=add_bos, add_eos=add_eos)
        texts = _texts(texts)
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        return [self._wrap(e.ids, add_bos, add_eos) for e in encodings]

    def pre_tokens(self, text: str) -> list[str]:
        """The pieces BPE segments `text` into (for tformer's byte-level BPE: words with their leading space,
        in the byte-level alphabet): the library's normalizer and pre-tokenizer, as `encode` applies them
        (added tokens that are not special, which `encode` keeps whole, are not split out here)."""
        (text,) = _texts([text], "text")
        normalizer, pre = self._backend.normalizer, self._backend.pre_tokenizer
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        return [piece for piece, _ in pre.pre_tokenize_str(text)] if pre is not None else [text]

    def _checked(self, ids: Iterable[int], where: str = "ids") -> list[int]:
        """ids as a list of ints in the vocabulary: a list, tuple or 1-D tensor / array of integers."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(f"{where} must be a sequence of int token ids, got {type(ids).__name__}")
        if getattr(ids, "ndim", 1) != 1:  # a tensor or array: one row only
            raise TypeError(f"{where} must be one sequence of token ids (1-D), got shape {tuple(ids.shape)}")
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if not all(type(i) is int for i in ids):  # the common case costs one pass; the rest is converted
            ids = [_token_id(i, where, n) for n, i in enumerate(ids)]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:  # the library drops such ids silently (or overflows on negative ones)
            raise ValueError(f"token id {bad} is outside this tokenizer's vocabulary of {self.vocab_size}")
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        require_bool(skip_special=skip_special)
        return self._backend.decode(self._checked(ids), skip_special_tokens=skip_special)

    def decode_batch(self, batch: Iterable[Iterable[int]], skip_special: bool = True) -> list[str]:
        require_bool(skip_special=skip_special)
        if isinstance(batch, (str, bytes)) or not isinstance(batch, Iterable):
            raise TypeError(f"batch must be a sequence of token id sequences, got {type(batch).__name__}")
        ragged = str(getattr(batch, "dtype", "")) == "object"  # a NumPy array of rows of different lengths
        if getattr(batch, "ndim", 2) != 2 and not ragged:
            raise TypeError(
                f"batch must hold one sequence of ids per row (2-D), got shape {tuple(batch.shape)}"
            )
        rows = batch.tolist() if hasattr(batch, "tolist") else batch
        return self._backend.decode_batch(
            [self._checked(ids, f"batch[{i}]") for i, ids in enumerate(rows)],
            skip_special_tokens=skip_special,
        )

    # ------------------------------------------------------------ storage

    def to_json_str(self) -> str:
        """The library's tokenizer.json content, for checkpoint metadata."""
        return self._backend.to_str()

    @classmethod
    def from_json_str(cls, text: str, where: str = "the text") -> Tokenizer:
        if not isinstance(text, str):
            raise TypeError(f"a tokenizer's JSON must be a str, got {type(text).__name__}")
        try:
            return cls(_Backend.from_str(text))
        except Exception as e:  # noqa: BLE001 (the tokenizers library raises plain Exception)
            raise ValueError(f"{where} is not a tokenizer.json file ({' '.join(str(e).split())})") from None

    def save(self, path: str | Path) -> Path:
        """Write tokenizer.json (to `path` if it names a .json file, else to `path/tokenizer.json`)."""
        path = Path(path)
        if path.suffix.lower() != ".json":
            path = path / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json_str(), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not a tokenizer.json file (not UTF-8 text)") from None
        return cls.from_json_str(text, str(path))

    def fingerprint(self) -> str:
        """Short sha256 of the JSON: equal fingerprints mean identical tokenizers."""
        return hashlib.sha256(self.to_json_str().encode("utf-8")).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and self.to_json_str() == other.to_json_str()

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens})"


def _texts(texts: Iterable[str], name: str = "texts") -> list[str]:
    """texts as a list of str, each valid Unicode (the library refuses a lone surrogate, e.g. from a file
    read with errors="surrogateescape", with a message that says only "must be str")."""
    if isinstance(texts, str) and name == "texts":
        raise TypeError("texts must be a list of strings; wrap one text in a list: [text]")
    if not isinstance(texts, Iterable):
        raise TypeError(f"{name} must be a list of strings, got {type(texts).__name__}")
    texts = list(texts)
    for i, text in enumerate(texts):
        where = name if name != "texts" else f"texts[{i}]"
        if not isinstance(text, str):
            raise TypeError(f"{where} must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where} is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start} "
                "(read text files as UTF-8 with errors='replace')"
            ) from None
    return texts


def _token_id(value: object, where: str, index: int | None = None) -> int:
    """value as an int: anything `operator.index` takes (ints, NumPy integers, 0-d integer tensors)
    except bools."""
    if not isinstance(value, bool) and str(getattr(value, "dtype", "")) not in ("bool", "torch.bool"):
        try:
            return operator.index(value)
        except TypeError:
            pass
    name = where if index is None else f"{where}[{index}]"
    raise TypeError(f"{name} must be an int token id, got {value!r}")


LONG_RUN = 1024  # characters: BPE training time grows with the square of a pre-token's length


def _pieces(texts: list[str]) -> Iterator[str]:
    """What BPE trains on: the texts, with runs of LONG_RUN or more non-space characters (minified code,
    base64, a language written without spaces), or of whitespace, cut into pieces of LONG_RUN, each its
    own sequence. A
    100,000-letter line had taken seconds, 300,000 a minute; merges are learned within pieces, and no
    text without such a run changes."""
    for text in texts:
        if len(text) < LONG_RUN or not _LONG.search(text):
            yield text
        else:
            yield from (piece for piece in _LONG.split(text) if piece)


_LONG = re.compile(rf"(\S{{{LONG_RUN}}}|\s{{{LONG_RUN}}})")  # letters or whitespace: each one pre-token
