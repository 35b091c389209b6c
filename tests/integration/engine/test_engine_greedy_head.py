"""The greedy head's screen (kernels/greedy_head.py) on the real model: a continuous batch of greedy
streams, some with penalties (which take the full logits), answers token for token as the full head
does, and the screen decides most of the steps it is offered."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import greedy_head, greedy_head_file, ops
from pdcluster.services.sampling_params import greedy
from pdcluster.services.model_cache import derived_dir
from tests.integration.engine.conftest import document, make_engine, run_staggered

pytestmark = pytest.mark.skipif(not greedy_head.available(), reason="needs the AVX-512 BF16 kernels and VNNI")


def test_screened_greedy_tokens_equal_the_full_heads(smol_bf16, monkeypatch):
    tok = smol_bf16.tokenizer
    model = smol_bf16.model
    prompts = [tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
               tok.encode("Once upon a time, in a land far away, there lived"),
               tok.encode(document(12, 2) + " In short,"),
               tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])]
    offered, decided = [], []
    choose = greedy_head.choose

    def counting(head, packed, x):
        got = choose(head, packed, x)
        offered.append(x.shape[0])
        decided.append(got is not None)
        return got

    monkeypatch.setattr(greedy_head, "choose", counting)
    engine = make_engine(smol_bf16)
    assert model.greedy_screen is not None  # built when the engine packed the weights
    screened = run_staggered(engine, prompts, greedy(40, ignore_eos=True), every_steps=8)
    penalised = run_staggered(make_engine(smol_bf16), prompts[:2], greedy(20, ignore_eos=True, presence_penalty=0.5))
    assert offered and sum(decided) >= 0.8 * len(decided), (sum(decided), len(decided))

    # The full head: the screen declines every row (setting greedy_screen to None would not do:
    # the next engine's pack_weights puts a screen back).
    def declined(head, packed, x):
        offered.append(-1)
        return None

    monkeypatch.setattr(greedy_head, "choose", declined)
    assert run_staggered(make_engine(smol_bf16), prompts, greedy(40, ignore_eos=True), every_steps=8) == screened
    assert run_staggered(make_engine(smol_bf16), prompts[:2],
                         greedy(20, ignore_eos=True, presence_penalty=0.5)) == penalised
    assert -1 in offered  # the full-head runs were offered the screen and declined it


def test_the_screen_kept_in_the_model_cache_is_the_one_built(smol_bf16, tmp_path):
    """Replicas read the screen the first one built (kernels/greedy_head_file.py): byte for byte
    the screen a fresh build gives, kept under the model cache when an engine packs the weights."""
    head = ops.unpack_linear_weight(smol_bf16.model.lm_head_weight)
    built = greedy_head.pack(head)
    kept = greedy_head.pack(head, keep_in=tmp_path)
    read_back = greedy_head.pack(head, keep_in=tmp_path)
    assert torch.equal(kept.packed, built.packed) and torch.equal(read_back.packed, built.packed)
    make_engine(smol_bf16)
    assert greedy_head_file.file_for(derived_dir(), head).is_file()
