"""K smoothing on the real model (pdcluster/services/engine/model/k_smoothing.py): the
shift is the same from a bf16 and an fp32 load of the checkpoint, and it
narrows real K rows, which is what it is for."""

from __future__ import annotations

import torch

from pdcluster.services.engine.model.k_smoothing import calibration_token_ids, k_smoothing_shift, post_rope_keys


def test_bf16_and_fp32_loads_get_one_shift_and_it_narrows_k_rows(smol_bf16, smol_fp32):
    ids = calibration_token_ids(smol_bf16.tokenizer)
    assert calibration_token_ids(smol_fp32.tokenizer) == ids
    shift = k_smoothing_shift(smol_bf16.model, ids)
    cfg = smol_bf16.config
    assert shift.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) and shift.dtype is torch.float32
    assert torch.equal(k_smoothing_shift(smol_fp32.model, ids), shift)
    # K of another text: each row's largest |value| (what sets its 8-bit scale) shrinks with the shift
    text = smol_bf16.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about rivers in Peru."}])
    keys = post_rope_keys(smol_bf16.model, text)[:, 1:]
    before = keys.abs().amax(-1).mean()
    after = (keys - shift[:, None].double()).abs().amax(-1).mean()
    assert after < 0.6 * before, (before, after)
