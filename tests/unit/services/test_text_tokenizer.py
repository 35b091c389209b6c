"""The torch-free tokenizer (pdcluster/services/text_tokenizer.py) gives
exactly what the transformers tokenizer gives, on the default model: ids,
text, token strings, special ids, chat templates; loading it imports neither
torch nor transformers.  The engine's Tokenizer built from a model path is
backed by it and loads the transformers one only when ``hf`` is asked for."""

from __future__ import annotations

import random
import subprocess
import sys

import jinja2
import pytest

from pdcluster.services.default_model import resolve_model_path
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.model_meta import read_model_config
from pdcluster.services.text_tokenizer import TextTokenizer, load_text_tokenizer

TEXTS = ["", "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "naïve café – 東京 🚀",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # square", "1234567890 3.14159 -2e10",
         "a" * 300, "<|endoftext|> in the middle <|endoftext|>", "ünïcödé ∑∫√ ḁ̶̝̈́ zalgo"]
CHATS = [[{"role": "user", "content": "Say hi."}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
         [{"role": "user", "content": "quotes \" ' and <html> & {{ braces }} {% raw %}"}],
         [{"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "é 🚀"}]]


@pytest.fixture(scope="module")
def pair():
    """(the TextTokenizer, the engine's Tokenizer over the transformers tokenizer itself)."""
    from transformers import AutoTokenizer

    from pdcluster.services.model_cache import tokenizer_dir

    path = resolve_model_path(None)
    config = read_model_config(path)
    light = load_text_tokenizer(tokenizer_dir(path), config.eos_token_ids)
    assert isinstance(light, TextTokenizer), "the default model's cache has tokenizer.json: no fallback"
    return light, Tokenizer(AutoTokenizer.from_pretrained(str(tokenizer_dir(path))), config.eos_token_ids)


def test_ids_text_and_token_strings_equal_the_transformers_tokenizer(pair):
    light, full = pair
    assert light.vocab_size == full.vocab_size
    assert light.eos_token_ids == full.eos_token_ids
    assert sorted(light.all_special_ids) == sorted(full.all_special_ids)
    for text in TEXTS:
        for special in (True, False):
            assert light.encode(text, special) == full.encode(text, special), (text, special)
    vocab = range(full.vocab_size)
    assert light.convert_ids_to_tokens(vocab) == full.convert_ids_to_tokens(vocab)
    rng = random.Random(0)
    specials = full.all_special_ids
    for n in (1, 2, 7, 40):
        for _ in range(25):
            ids = [rng.randrange(full.vocab_size) for _ in range(n)] + rng.sample(specials, k=min(2, len(specials)))
            rng.shuffle(ids)
            for skip in (True, False):
                assert light.decode(ids, skip) == full.decode(ids, skip), (ids, skip)


def test_chat_templates_render_as_transformers_renders_them(pair):
    light, full = pair
    assert light.chat_template == full.chat_template
    for messages in CHATS:
        assert light.apply_chat_template(messages) == full.apply_chat_template(messages)
        for gen in (True, False):
            assert light.render_chat(messages, gen) == full.render_chat(messages, gen)


def test_a_template_using_tojson_loop_controls_and_raise_exception_renders_the_same(pair):
    light, full = pair
    # Blocks on lines of their own, indented: trim_blocks and lstrip_blocks change the text.
    source = ("{% for m in messages %}\n"
              "    {% if m['role'] == 'tool' %}{% continue %}{% endif %}\n"
              "{{ bos_token }}{{ m | tojson }}\n"
              "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
              "{% endfor %}\n"
              "{% if messages[-1]['role'] == 'assistant' %}{{ raise_exception('ends with the assistant') }}{% endif %}\n"
              "{% if add_generation_prompt %}<go>{% endif %}")
    mine = TextTokenizer(light.tk, {**{k: v for k, v in light.named_special.items()}}, source, light.eos_token_ids)
    before = full.hf.chat_template
    full.hf.chat_template = source
    try:
        for messages in CHATS[:3] + [[{"role": "user", "content": "<b>&</b> é"}]]:
            if messages[-1]["role"] == "assistant":
                with pytest.raises(jinja2.exceptions.TemplateError, match="ends with the assistant"):
                    mine.render_chat(messages)
                continue
            assert mine.render_chat(messages) == full.render_chat(messages)
    finally:
        full.hf.chat_template = before


def test_no_chat_template_is_a_value_error_naming_the_fix(pair):
    light, _ = pair
    bare = TextTokenizer(light.tk, {}, None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])


def test_the_gateway_loads_it_without_torch_or_transformers():
    code = ("import sys\n"
            "import pdcluster.services.gateway.deployment as d\n"
            "from pdcluster.services.default_model import resolve_model_path\n"
            "from pdcluster.services.model_meta import read_model_config\n"
            "p = resolve_model_path(None)\n"
            "t = d.Tokenizer.from_path(p, read_model_config(p))  # what the gateway builds\n"
            "assert t.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    assert _python(code).strip() == "[]"


def test_the_engines_tokenizer_works_from_the_cache_files_and_loads_transformers_only_for_hf():
    code = ("import sys\n"
            "from pdcluster.services.default_model import resolve_model_path\n"
            "from pdcluster.services.model_meta import read_model_config\n"
            "from pdcluster.services.tokenizer import Tokenizer\n"
            "p = resolve_model_path(None)\n"
            "t = Tokenizer.from_path(p, read_model_config(p))\n"
            "ids = t.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "assert t.decode(ids, False) and t.encode('hi') and t.vocab_size > 0\n"
            "before = 'transformers' in sys.modules\n"
            "assert len(t.hf) == t.vocab_size and t.hf.encode('hi') == t.encode('hi')\n"
            "print(before, 'transformers' in sys.modules)\n")
    assert _python(code).split() == ["False", "True"]


def _python(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (which modules it imports is the point)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
