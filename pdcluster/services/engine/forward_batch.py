"""What one forward pass computes, passed explicitly to the model.

Tokens of all scheduled sequences are laid out back to back, decode rows
first (one token each: a decode step, or one recomputed output position of
a resumed request, runner.py), then prefill chunks::

    input_ids: [ d0 d1 .. d(D-1) | p0 p0 p0 .. | p1 p1 .. | ... ]
                 decode part        prefill part (ragged, query_start_loc)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64, where each token's K/V goes
    num_decode_tokens: int         # D: the first D tokens are decode tokens
    decode_block_tables: torch.Tensor     # [D, max_blocks] int32
    decode_context_lens: torch.Tensor     # [D] int32 (incl. the new token)
    prefill_block_tables: torch.Tensor    # [P, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [P+1] int32, offsets into the prefill part
    prefill_context_lens: torch.Tensor    # [P] int32 (incl. the new chunk)
    logits_indices: torch.Tensor   # [N] int64: rows whose next-token logits we need
    # [P] int32: 1 = a prompt chunk, which over an 8-bit pool attends to its own
    # K/V as computed (pdcluster/kernels/prefill_attention.py); 0 = a draft's verification,
    # which reads every key from the pool, as the decode steps it stands for do
    prefill_fresh_kv: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
