"""Tokenizer and chat template from the same source as the weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]):
        self.hf = hf_tokenizer
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))

    @classmethod
    def from_path(cls, path: Path, config) -> "Tokenizer":
        from transformers import AutoTokenizer

        from pdcluster.services.model_cache import tokenizer_dir

        # a GGUF's tokenizer is read from its converted copy (pdcluster/services/model_cache.py)
        hf = AutoTokenizer.from_pretrained(str(tokenizer_dir(path) if path.is_file() else path))
        return cls(hf, config.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(token_ids))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @property
    def all_special_ids(self) -> list[int]:
        return list(getattr(self.hf, "all_special_ids", ()) or ())

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages``."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt token ids for a chat, ending with the assistant turn's opening."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)
