"""A character-level language-modelling dataset for the GPT demo.

`CharDataset` turns a text into int64 token ids (one id per distinct
character) and serves next-character prediction windows. Without a text it
loads ``corpus.txt``, which ships inside the package, so nothing is ever
downloaded.

About ``corpus.txt``: original English prose (short essays on data-parallel
training and ZeRO, fables, dialogues, descriptions) written for zerosim by
its authors and dedicated to the public domain under CC0 1.0
(https://creativecommons.org/publicdomain/zero/1.0/). It is plain ASCII.
See docs/data.md.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from zerosim.data.datasets import check_indices
from zerosim.data.sampler import check_int

CORPUS_FILE = "corpus.txt"


def load_corpus() -> str:
    """The text of the corpus shipped with zerosim (``zerosim/data/corpus.txt``)."""
    return resources.files("zerosim.data").joinpath(CORPUS_FILE).read_text(encoding="utf-8")


def _codepoints(s: str) -> np.ndarray:
    """The Unicode code points of ``s`` as a uint32 array (no Python loop)."""
    return np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32)


class CharDataset:
    """Next-character windows over a text: sample ``i`` is ``(ids[i:i+T], ids[i+1:i+T+1])``.

    ``T = block_size``; there are ``len(ids) - T`` samples. The vocabulary is
    the sorted set of characters of the text: ``stoi`` maps a character to its
    id, ``itos`` an id to its character.

    ``text``: ``None`` loads the shipped corpus; a ``str`` is the text itself;
    an ``os.PathLike`` (e.g. ``pathlib.Path``) is a UTF-8 file to read. A plain
    string is never taken for a file name; use `CharDataset.from_file` or a
    ``Path`` for that.

    ``ds[idx]`` with an int array of shape (B,) returns two int64 arrays of
    shape (B, T) built by one gather, ``ids[idx[:, None] + arange(T)]``.
    """

    def __init__(self, text: str | os.PathLike | None = None, block_size: int = 128) -> None:
        if text is None:
            text = load_corpus()
        elif isinstance(text, os.PathLike):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        elif not isinstance(text, str):
            raise TypeError(
                f"text must be a str, an os.PathLike or None, got {type(text).__name__}"
            )
        self.block_size = check_int("block_size", block_size, 1)
        if len(text) < self.block_size + 1:
            raise ValueError(
                f"text has {len(text)} characters; block_size={self.block_size} needs at "
                f"least {self.block_size + 1} (to read a file, pass a pathlib.Path)"
            )
        chars = sorted(set(text))
        self._codepoints = _codepoints("".join(chars))
        self.stoi: dict[str, int] = {ch: i for i, ch in enumerate(chars)}
        self.itos: dict[int, str] = dict(enumerate(chars))
        self.text = text
        self.ids = self.encode(text)
        self._offsets = np.arange(self.block_size, dtype=np.int64)

    @classmethod
    def from_file(cls, path: str | os.PathLike, block_size: int = 128) -> CharDataset:
        """Read a UTF-8 text file and build the dataset from its contents."""
        return cls(Path(path), block_size)

    @property
    def vocab_size(self) -> int:
        return len(self.stoi)

    def encode(self, s: str) -> np.ndarray:
        """Token ids (int64) of ``s``; every character must be in the vocabulary."""
        unknown = sorted(set(s) - self.stoi.keys())
        if unknown:
            raise ValueError(
                f"characters {unknown[:10]!r} are not in the vocabulary of "
                f"{self.vocab_size} characters"
            )
        # chars are sorted by code point, so a character's id is its rank among them
        return np.searchsorted(self._codepoints, _codepoints(s)).astype(np.int64)

    def decode(self, ids: Any) -> str:
        """The string of token ids ``ids`` (any int sequence or 1-D array)."""
        return "".join(self.itos[int(i)] for i in np.asarray(ids).reshape(-1))

    def __len__(self) -> int:
        return len(self.ids) - self.block_size

    def __getitem__(self, idx: Any) -> tuple[np.ndarray, np.ndarray]:
        check_indices(idx, len(self))
        window = np.asarray(idx)[..., None] + self._offsets
        return self.ids[window], self.ids[window + 1]
