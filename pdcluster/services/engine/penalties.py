"""Every per-request change to the logits before sampling: ``min_tokens``,
``logit_bias`` and the repetition / frequency / presence penalties.  Applied
in vLLM's order, all before temperature, top-k and top-p, so a greedy request
takes the argmax of the adjusted logits::

    1. min_tokens   while fewer than min_tokens tokens are out:
                    logits[t] = -inf for t in EOS (unless ignore_eos) and stop_token_ids
    2. logit_bias   logits[t] += bias[t]
    3. repetition   t in the prompt or the output: logits[t] / p if logits[t] > 0 else logits[t] * p
    4. frequency,   logits[t] -= frequency * count[t] + presence * (count[t] > 0),
       presence     count[t] = how often t is in the output (never the prompt)

Only the entries these change are touched.  The rows that ask have their
token ids flattened with their row index, so each step is one gather, one
elementwise expression and one ``index_put_`` over those (row, token) pairs
for the whole batch -- no tensor op per row, no [rows, vocab] temporary::

    output ids  [ a0 a1 a2 | b0 | c0 c1 ]  rows [ 0 0 0 | 3 | 5 5 ]   (batch rows 0, 3, 5)
    frequency   unique (row, token) pairs and their counts
    repetition  the output pairs, plus each prompt's ids (cached per request, built once)

A batch in which no row asks never gets here (``SamplingParams.adjusts_logits``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdcluster.services.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What the penalties read of a request (the engine's Request is one)."""
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class _NoHistory:
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()


_NO_HISTORY = _NoHistory()


@dataclass
class _Plan:
    """One step's adjustments as flat lists of (batch row, token id) pairs."""
    num_rows: int
    mask_rows: list[int] = field(default_factory=list)     # (row, token) -> -inf
    mask_ids: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)     # (row, token) += bias
    bias_ids: list[int] = field(default_factory=list)
    biases: list[float] = field(default_factory=list)
    out_rows: list[int] = field(default_factory=list)      # penalised rows, with their
    out_lens: list[int] = field(default_factory=list)      # numbers of output tokens and
    out_ids: list[int] = field(default_factory=list)       # those tokens, concatenated
    prompt_rows: list[int] = field(default_factory=list)   # rows with a repetition penalty
    prompt_ids: list[torch.Tensor] = field(default_factory=list)  # and their prompts' ids
    repetition: dict[int, float] = field(default_factory=dict)    # row -> penalty, where not off
    frequency: dict[int, float] = field(default_factory=dict)
    presence: dict[int, float] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.mask_ids or self.bias_ids or self.out_rows)


class Penalties:
    def __init__(self, eos_token_ids: Sequence[int] = (), histories: Mapping[str, TokenHistory] | None = None):
        """``histories``: each live request's tokens by request id (the
        engine's request table); a request not in it has none yet."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.histories: Mapping[str, TokenHistory] = {} if histories is None else histories
        self._prompt_ids: dict[str, torch.Tensor] = {}  # request id -> its prompt's ids, built once

    def forget(self, request_id: str) -> None:
        self._prompt_ids.pop(request_id, None)

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]) -> torch.Tensor:
        """``logits`` (fp32 [N, vocab]) with each row's adjustments, as a new
        tensor; ``logits`` itself if no row has one this step."""
        plan = self._plan(request_ids, params, logits.shape[-1], logits.device)
        return logits if plan.is_empty else _adjusted(logits.clone(), plan)

    def _plan(self, request_ids: Sequence[str], params: Sequence[SamplingParams], vocab: int,
              device: torch.device) -> _Plan:
        plan = _Plan(len(params))
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if not p.adjusts_logits:
                continue
            history = self.histories.get(rid, _NO_HISTORY)
            if len(history.output_token_ids) < p.min_tokens:
                stops = p.stop_token_ids if p.ignore_eos else self.eos_token_ids + p.stop_token_ids
                stops = [t for t in stops if t < vocab]  # stop ids are not checked against the vocabulary
                plan.mask_rows.extend([row] * len(stops))
                plan.mask_ids.extend(stops)
            if p.logit_bias:
                plan.bias_rows.extend([row] * len(p.logit_bias))
                for token_id, bias in p.logit_bias:
                    plan.bias_ids.append(token_id)
                    plan.biases.append(bias)
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                plan.out_rows.append(row)
                plan.out_lens.append(len(history.output_token_ids))
                plan.out_ids.extend(history.output_token_ids)
            if p.repetition_penalty != 1.0:
                plan.repetition[row] = p.repetition_penalty
                plan.prompt_rows.append(row)
                plan.prompt_ids.append(self._prompt_tensor(rid, history, device))
            if p.frequency_penalty or p.presence_penalty:
                plan.frequency[row] = p.frequency_penalty
                plan.presence[row] = p.presence_penalty
        return plan

    def _prompt_tensor(self, request_id: str, history: TokenHistory, device: torch.device) -> torch.Tensor:
        ids = self._prompt_ids.get(request_id)
        if ids is None or ids.device != device:
            ids = torch.tensor(history.prompt_token_ids, dtype=torch.int64, device=device)
            self._prompt_ids[request_id] = ids
        return ids


def _adjusted(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Steps 1-4 of the module docstring, in place on ``x`` (a copy of the
    logits).  Each step reads and writes only the entries it changes: a
    gather, one elementwise expression, a scatter -- never a [rows, vocab]
    temporary."""
    dev, dtype, vocab = x.device, x.dtype, x.shape[-1]

    def ids(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=dev)

    def per_row(by_row: dict[int, float], neutral: float) -> torch.Tensor:
        values = [neutral] * plan.num_rows
        for row, value in by_row.items():
            values[row] = value
        return torch.tensor(values, dtype=dtype, device=dev)

    if plan.mask_ids:
        x.index_put_((ids(plan.mask_rows), ids(plan.mask_ids)), torch.tensor(float("-inf"), device=dev))
    if plan.bias_ids:
        x.index_put_((ids(plan.bias_rows), ids(plan.bias_ids)), torch.tensor(plan.biases, dtype=dtype, device=dev),
                     accumulate=True)
    if not plan.out_rows:
        return x
    out_rows = torch.repeat_interleave(ids(plan.out_rows), ids(plan.out_lens))
    out_ids = ids(plan.out_ids)
    if plan.repetition:
        # Every (row, token) of the prompt or output, repeats included: each
        # copy of a pair writes the same value, computed from the same read.
        rows = torch.cat([out_rows, torch.repeat_interleave(ids(plan.prompt_rows),
                                                            ids([len(t) for t in plan.prompt_ids]))])
        cols = torch.cat([out_ids, *plan.prompt_ids])
        p = per_row(plan.repetition, 1.0)[rows]
        v = x[rows, cols]
        x.index_put_((rows, cols), torch.where(v > 0, v / p, v * p))
    if plan.frequency:
        pairs, counts = torch.unique(out_rows * vocab + out_ids, return_counts=True)
        rows, cols = pairs // vocab, pairs % vocab
        # presence * (count > 0) is presence itself: only tokens in the output are here.
        penalty = per_row(plan.frequency, 0.0)[rows] * counts.to(dtype) + per_row(plan.presence, 0.0)[rows]
        x.index_put_((rows, cols), x[rows, cols] - penalty)
    return x
