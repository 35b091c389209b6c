"""Tokenizer and chat template from the same source as the weights."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    """Text <-> token ids for the engine.  Built from a model path, it works
    from the model cache's own files (pdcluster/services/text_tokenizer.py:
    no transformers import, about 1.7 s less of every replica's start) and
    loads the transformers tokenizer only when something asks for ``hf``
    (xgrammar's vocabulary, a draft model's vocabulary check)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]):
        self._hf, self._load_hf, self._text = hf_tokenizer, None, None
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))

    @classmethod
    def of_text(cls, text: Any, load_hf: Callable[[], Any]) -> "Tokenizer":
        """Backed by a TextTokenizer; ``load_hf`` makes the transformers one on first use of ``hf``."""
        self = cls.__new__(cls)
        self._hf, self._load_hf, self._text = None, load_hf, text
        self.eos_token_ids = tuple(text.eos_token_ids)
        return self

    @classmethod
    def from_path(cls, path: Path, config) -> "Tokenizer":
        from pdcluster.services.model_cache import tokenizer_dir
        from pdcluster.services.text_tokenizer import load_text_tokenizer

        # a GGUF's tokenizer is read from its converted copy (pdcluster/services/model_cache.py)
        directory = tokenizer_dir(path) if path.is_file() else path

        def load_hf():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(directory))

        text = load_text_tokenizer(directory, config.eos_token_ids)
        if text is not None:
            return cls.of_text(text, load_hf)
        return cls(load_hf(), config.eos_token_ids)

    @property
    def hf(self) -> Any:
        if self._hf is None:
            self._hf = self._load_hf()
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._text.vocab_size if self._text is not None else len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._text is not None:
            return self._text.encode(text, add_special_tokens)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._text is not None:
            return self._text.decode(token_ids, skip_special_tokens)
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        if self._text is not None:
            return self._text.convert_ids_to_tokens(token_ids)
        return self.hf.convert_ids_to_tokens(list(token_ids))

    @property
    def chat_template(self) -> str | None:
        if self._text is not None:
            return self._text.chat_template
        return getattr(self.hf, "chat_template", None)

    @property
    def all_special_ids(self) -> list[int]:
        if self._text is not None:
            return list(self._text.all_special_ids)
        return list(getattr(self.hf, "all_special_ids", ()) or ())

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages``."""
        if self._text is not None:
            return self._text.render_chat(messages, add_generation_prompt)
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt token ids for a chat, ending with the assistant turn's opening."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)
