"""The bundled GGUF's converted copy (pdcluster/services/model_cache.py) holds what
transformers reads from the GGUF itself: the same tensors bit for bit (its
dequantization and q/k row order, not ours), the same tokenizer, the same
shape."""

from __future__ import annotations

import torch

from pdcluster.services import model_cache
from pdcluster.services.default_model import default_model_path
from tests.integration.engine.conftest import _hf_model


def test_converted_tensors_equal_transformers_own_gguf_read():
    from safetensors.torch import load_file

    ours = load_file(str(model_cache.tensors_file(default_model_path())))
    theirs = _hf_model(torch.float32).state_dict()
    assert set(ours) <= set(theirs), set(ours) - set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name]), name
    # a tied lm_head is not stored: the model reads it from the embedding
    assert set(theirs) - set(ours) <= {"lm_head.weight"}


def test_converted_tokenizer_encodes_decodes_and_templates_like_the_gguf_one():
    from transformers import AutoTokenizer

    path = default_model_path()
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(str(model_cache.tokenizer_dir(path)))
    texts = ["Hello world!", "naïve café 日本語 🚀 \t\n  two  spaces", "<|im_start|>user\nhi<|im_end|>\n",
             "def f(x):\n    return x**2  # 42", ""]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
    ids = list(range(0, len(theirs), 97))
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (theirs.eos_token_id, theirs.bos_token_id, len(theirs))


def test_converted_config_is_what_transformers_read_from_the_gguf():
    ours = model_cache.cached_config(default_model_path())
    hf = _hf_model(torch.float32).config
    assert (ours.num_layers, ours.hidden_size, ours.intermediate_size, ours.num_heads, ours.num_kv_heads,
            ours.vocab_size, ours.max_position_embeddings, ours.tie_word_embeddings) == (
        hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.vocab_size, hf.max_position_embeddings, hf.tie_word_embeddings)
    theta = hf.rope_parameters["rope_theta"] if getattr(hf, "rope_parameters", None) else hf.rope_theta
    assert ours.rope_theta == theta
    assert ours.rms_norm_eps == hf.rms_norm_eps
