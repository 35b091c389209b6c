"""Turns a scheduled step into one batched forward and samples its tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from services.engine.forward_batch import ForwardBatch
from services.engine.kv_cache import KVCache
from services.engine.logprobs import PromptSpan, SampledLogprobs, prompt_span, record_prompt_logprobs
from services.engine.model.llama import LlamaModel
from services.engine.penalties import TokenHistory
from services.engine.request import Request
from services.engine.sampler import SampleResult, Sampler
from services.engine.scheduler import ScheduledRequest, SchedulerOutput


def _token_at(req: Request, pos: int) -> int:
    n = req.num_prompt_tokens
    return req.prompt_token_ids[pos] if pos < n else req.output_token_ids[pos - n]


def _tokens(req: Request, start: int, end: int) -> list[int]:
    n = req.num_prompt_tokens
    if end <= n:
        return req.prompt_token_ids[start:end]
    return (req.prompt_token_ids + req.output_token_ids)[start:end]


def _table(rows: list[list[int]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).reshape(len(rows), width)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, device: str | torch.device = "cpu",
                 eos_token_ids: Sequence[int] = (), histories: Mapping[str, TokenHistory] | None = None):
        """``eos_token_ids`` and ``histories`` (the live requests by id) are
        what the sampler's min_tokens and penalties read."""
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.block_size = kv.spec.block_size
        self.sampler = Sampler(eos_token_ids, histories)

    def build_batch(self, out: SchedulerOutput
                    ) -> tuple[ForwardBatch, list[Request], list[PromptSpan], list[ScheduledRequest]]:
        """The step's ForwardBatch, the requests to sample in row order, the
        prompt positions whose logits prompt logprobs need, and the drafted
        steps to verify (spec_decode.py), in this order in ``logits_indices``::

            logits_indices  [ sampled rows (one per request) | verify rows (k+1 per draft)
                              | prompt-logprob rows (spans, in order) ]
        """
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        spans: list[PromptSpan] = []
        prompt_rows: list[int] = []
        drafted: list[ScheduledRequest] = []
        verify_rows: list[int] = []

        def place(s: ScheduledRequest) -> None:
            r, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            span = prompt_span(r, start, end) if r.params.prompt_logprobs is not None else None
            if span is not None:
                spans.append(span)
                prompt_rows.extend(range(len(ids), len(ids) + span.count))
            if s.spec_token_ids:
                drafted.append(s)
                verify_rows.extend(range(len(ids), len(ids) + s.num_new_tokens))
                ids.extend([_token_at(r, start)] + s.spec_token_ids)
            else:
                ids.extend(_tokens(r, start, end) if s.num_new_tokens > 1 else [_token_at(r, start)])
            pos.extend(range(start, end))
            table = r.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.samples and not s.spec_token_ids:
                logits_rows.append(len(ids) - 1)
                sampled.append(r)

        for s in out.decodes:
            place(s)
        q_starts = [0]
        for s in out.prefills:
            place(s)
            q_starts.append(q_starts[-1] + s.num_new_tokens)
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=dev)

        batch = ForwardBatch(
            input_ids=t(ids, torch.int64),
            positions=t(pos, torch.int64),
            slot_mapping=t(slots, torch.int64),
            num_decode_tokens=len(out.decodes),
            decode_block_tables=_table([s.request.block_ids for s in out.decodes]).to(dev),
            decode_context_lens=t([s.request.num_computed_tokens + 1 for s in out.decodes], torch.int32),
            prefill_block_tables=_table([s.request.block_ids for s in out.prefills]).to(dev),
            prefill_query_start_loc=t(q_starts, torch.int32),
            prefill_context_lens=t([s.request.num_computed_tokens + s.num_new_tokens for s in out.prefills], torch.int32),
            logits_indices=t(logits_rows + verify_rows + prompt_rows, torch.int64),
            prefill_fresh_kv=t([0 if s.spec_token_ids else 1 for s in out.prefills], torch.int32),
        )
        return batch, sampled, spans, drafted

    def execute(self, out: SchedulerOutput) -> SampleResult:
        """Runs the step; returns the sampled token of each request whose
        prompt is done, and which of them failed (non-finite logits)."""
        batch, to_sample, spans, drafted = self.build_batch(out)
        logits = self.model(batch, self.kv.kv_pool)
        n_sampled = len(to_sample)
        n_verify = sum(s.num_new_tokens for s in drafted)
        if spans:
            record_prompt_logprobs(logits[n_sampled + n_verify:], spans)
        verified = self.sampler.verify_batch(logits[n_sampled:n_sampled + n_verify], drafted) if drafted else None
        logits = logits[:n_sampled]
        if not to_sample:
            return verified or SampleResult({}, {})
        result = self._sample(logits, to_sample)
        return result if verified is None else result.merged(verified)

    def _sample(self, logits: torch.Tensor, to_sample: list[Request]) -> SampleResult:
        request_ids, params = [r.request_id for r in to_sample], [r.params for r in to_sample]
        asked = SampledLogprobs.of(logits, request_ids, params)  # the raw logits, before the sampler's changes
        result = self.sampler.sample_batch(logits, request_ids, params)
        if asked is not None:
            result = dataclasses.replace(result, logprobs=asked.score(result.token_ids))
        if any(p.prompt_logprobs is not None for p in params):
            # Their prompt is done this step: its logprobs leave with the first token.
            done = {r.request_id: list(r.prompt_logprobs) for r in to_sample
                    if r.params.prompt_logprobs is not None and not r.output_token_ids}
            result = dataclasses.replace(result, prompt_logprobs=done)
        return result
