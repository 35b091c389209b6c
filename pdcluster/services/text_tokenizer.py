"""The tokenizer the gateway needs, without torch or transformers.

The gateway only turns text into token ids and back (prompts, chat
templates, /tokenize, logprob spellings); it runs no model.  Loading the
transformers tokenizer there imported torch and transformers (about 2 s of
CPU at every gateway start, and their memory for the replica's life).  This
reads the same files from the model cache (pdcluster/services/model_cache.py
writes them for a GGUF; a Hugging Face directory has them already):

    tokenizer.json           the `tokenizers` library's own model: encode, decode, id <-> token
    tokenizer_config.json    the named special tokens (bos, eos, ...), extra special tokens, clean-up flag
    chat_template.jinja      the chat template (or ``chat_template`` in the config)

and renders the chat template in a sandboxed jinja2 environment set up as
transformers sets up its own (trim_blocks, lstrip_blocks, loop controls, a
``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``,
the special tokens as variables), for plain role/content messages, which is
all the gateway renders (chat_messages.py).  ``load_text_tokenizer`` gives
None where these files cannot say everything (no tokenizer.json, or a
clean-up transformers would apply): the engine's Tokenizer then loads the
transformers one.
tests/unit/services/test_text_tokenizer.py holds both to the same output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EXTRA_SPECIAL_TOKENS = ("extra_special_tokens", "additional_special_tokens")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class TextTokenizer:
    def __init__(self, tokenizer: Any, config: dict[str, Any], chat_template: str | None,
                 eos_token_ids: Sequence[int] = ()):
        self.tk = tokenizer
        self.named_special = {k: t for k in NAMED_SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        extra = next((config[k] for k in EXTRA_SPECIAL_TOKENS if config.get(k)), ())
        extra = extra.values() if isinstance(extra, dict) else extra
        self.extra_special = [t for v in extra if (t := _token_text(v)) is not None]
        self.chat_template = chat_template
        eos = set(eos_token_ids)
        eos_text = self.named_special.get("eos_token")
        if eos_text is not None and (i := self.tk.token_to_id(eos_text)) is not None:
            eos.add(int(i))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))

    @classmethod
    def from_dir(cls, directory: Path, eos_token_ids: Sequence[int] = ()) -> TextTokenizer:
        from tokenizers import Tokenizer as RustTokenizer

        config = json.loads((directory / "tokenizer_config.json").read_text()) \
            if (directory / "tokenizer_config.json").is_file() else {}
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(RustTokenizer.from_file(str(directory / "tokenizer.json")), config,
                   template if isinstance(template, str) else None, eos_token_ids)

    # ---- the engine Tokenizer's interface the gateway uses -------------
    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        return [self.tk.id_to_token(int(i)) for i in token_ids]

    @cached_property
    def all_special_ids(self) -> list[int]:
        seen: list[str] = []
        for t in [*self.named_special.values(), *self.extra_special]:
            if t not in seen:
                seen.append(t)
        ids = [self.tk.token_to_id(t) for t in seen]
        return [i for i in ids if i is not None]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (jinja2's TemplateError when the template refuses them)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        return _compiled(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    tools=None, documents=None, **self.named_special,
                                                    additional_special_tokens=list(self.extra_special))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt token ids for a chat, ending with the assistant turn's opening."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str):
    """The template in a sandboxed environment set up as transformers sets up its own."""
    template = _TEMPLATES.get(source)
    if template is None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = _TEMPLATES[source] = env.from_string(source)
    return template


def load_text_tokenizer(directory: Path, eos_token_ids: Sequence[int] = ()) -> TextTokenizer | None:
    """A TextTokenizer from a tokenizer directory (the model cache's copy for a
    GGUF, or a Hugging Face model directory); None where its files cannot say
    everything."""
    settings = directory / "tokenizer_config.json"
    cleans_up = settings.is_file() and json.loads(settings.read_text()).get("clean_up_tokenization_spaces")
    if (directory / "tokenizer.json").is_file() and not cleans_up:
        return TextTokenizer.from_dir(directory, eos_token_ids)
    return None
