"""Tokenizers: the byte-level one of the built-in models, and a wrapper of a Hugging Face
``tokenizer.json`` (the ``tokenizers`` library). Both expose ``encode``, ``decode``,
``bos_token_id``, ``eos_token_id`` and ``vocab_size``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, ``<bos>`` = 256, ``<eos>`` = 257 (vocab_size 258).

    ``encode`` prepends ``<bos>`` when ``add_special_tokens`` (the default); ``decode`` drops
    special ids and replaces invalid UTF-8 with U+FFFD.

    >>> ByteTokenizer().encode("hi")
    [256, 104, 105]
    """

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    #: names the vocabulary: equal digests encode and decode text alike (see HFTokenizer.digest)
    digest = "kvflow-byte-258"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with ``tokenizers.Tokenizer``.

    Parameters
    ----------
    path : str
        Checkpoint directory holding ``tokenizer.json`` (and optionally ``config.json`` /
        ``tokenizer_config.json`` giving the bos/eos tokens).

    Raises
    ------
    FileNotFoundError
        If ``path/tokenizer.json`` is missing.
    ValueError
        If ``tokenizers`` cannot read it (naming the file).
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"path={path!r} has no tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # tokenizers raises a plain Exception for a broken file
            raise ValueError(f"{file} cannot be read by tokenizers: {exc}") from None
        with open(file, "rb") as f:
            #: blake2b (16 hex digits) of tokenizer.json: equal digests encode and decode alike
            self.digest = "tokenizer.json:" + hashlib.blake2b(f.read(), digest_size=8).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._special(path, "bos")
        self.eos_token_id = self._special(path, "eos")

    def _special(self, path: str, kind: str) -> int | None:
        for fname in ("config.json", "generation_config.json"):
            cfg = _read_json(os.path.join(path, fname))
            v = cfg.get(f"{kind}_token_id")
            if isinstance(v, list) and v:
                v = v[0]
            if isinstance(v, int):
                return v
        tok = _read_json(os.path.join(path, "tokenizer_config.json")).get(f"{kind}_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        return self._tok.token_to_id(tok) if isinstance(tok, str) else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _read_json(file: str) -> dict:
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)
