"""Turns a scheduled step into one batched forward and samples its tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from pdcluster.services.engine.forward_batch import ForwardBatch
from pdcluster.services.engine.kv_cache import KVCache
from pdcluster.services.engine.logprobs import PromptSpan, SampledLogprobs, prompt_span, record_prompt_logprobs
from pdcluster.services.engine.model.llama import LlamaModel
from pdcluster.services.engine.penalties import TokenHistory
from pdcluster.services.engine.request import Request
from pdcluster.services.engine.sampler import SampleResult, Sampler
from pdcluster.services.engine.scheduler import ScheduledRequest, SchedulerOutput


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


def replay_start(s: ScheduledRequest, exact_resume: bool) -> int:
    """Where ``s``'s chunk stops being prompt: the output positions from here
    to the chunk's end are recomputed decode-shaped (one decode row each)
    when ``exact_resume``; the chunk's end when nothing is replayed (no
    output positions, replay off, or a drafted step, which verify_batch reads
    as one chunk)."""
    r = s.request
    end = r.num_computed_tokens + s.num_new_tokens
    if not exact_resume or s.spec_token_ids:
        return end
    return min(end, max(r.num_computed_tokens, r.num_prompt_tokens))


def _plain_greedy(req: Request) -> bool:
    """The row needs only its argmax of the raw logits: greedy, nothing that reads or changes the logits
    (logprobs, prompt logprobs, penalties, logit bias, min_tokens, a grammar)."""
    p = req.params
    return (p.greedy and not p.adjusts_logits and p.logprobs is None and p.guided is None
            and req.draw.prompt_logprobs is None)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, device: str | torch.device = "cpu",
                 eos_token_ids: Sequence[int] = (), histories: Mapping[str, TokenHistory] | None = None,
                 exact_resume: bool = True):
        """``eos_token_ids`` and ``histories`` (the live requests by id) are
        what the sampler's min_tokens and penalties read; ``exact_resume``:
        see build_batch."""
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.block_size = kv.spec.block_size
        self.exact_resume = exact_resume
        self.sampler = Sampler(eos_token_ids, histories)
        # Plain greedy rows take their token from the model's screened head where it has one
        # (LlamaModel.greedy_tokens), not from the sampler's logits; off: every row through the sampler.
        self.screen_greedy = True

    def build_batch(self, out: SchedulerOutput
                    ) -> tuple[ForwardBatch, list[Request], list[PromptSpan], list[ScheduledRequest]]:
        """The step's ForwardBatch, the requests to sample in row order, the
        prompt positions whose logits prompt logprobs need, and the drafted
        steps to verify (spec_decode.py), in this order in ``logits_indices``::

            logits_indices  [ sampled rows (one per request) | verify rows (k+1 per draft)
                              | prompt-logprob rows (spans, in order) ]

        With ``exact_resume``, a chunk that recomputes output positions (a
        resumed or preempted request) is split: its prompt part stays a
        prefill chunk, and each output position becomes a decode row of its
        own (context = the position + 1), as the original decode step ran it::

            input_ids  [ decodes | replayed output positions | prompt parts of the chunks ]
                         decode rows (one query each)          prefill rows (ragged)

        Every other kernel of the forward computes a row independently of the
        rows beside it, so a replayed position gets the K/V and logits the
        original decode step got, bit for bit (bench/micro/resume_identity.py).
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
        decode_rows: list[tuple[Request, int]] = []  # (request, position): its table, context = position + 1

        def place(s: ScheduledRequest, start: int, end: int, samples: bool) -> None:
            r = s.request
            span = prompt_span(r, start, end) if r.draw.prompt_logprobs is not None else None
            if span is not None:
                spans.append(span)
                prompt_rows.extend(range(len(ids), len(ids) + span.count))
            if s.spec_token_ids:
                drafted.append(s)
                verify_rows.extend(range(len(ids), len(ids) + s.num_new_tokens))
                ids.extend([_token_at(r, start)] + s.spec_token_ids)
            else:
                ids.extend(_tokens(r, start, end) if end - start > 1 else [_token_at(r, start)])
            pos.extend(range(start, end))
            table = r.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if samples and not s.spec_token_ids:
                logits_rows.append(len(ids) - 1)
                sampled.append(r)

        chunks: list[tuple[ScheduledRequest, int, int]] = []  # (entry, start, end) of each prefill part
        replays: list[tuple[ScheduledRequest, int, int]] = []  # (entry, start, end) of output positions
        for s in out.prefills:
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            cut = replay_start(s, self.exact_resume)
            if cut < end:
                replays.append((s, cut, end))
            if cut > start:
                chunks.append((s, start, cut))
        for s in out.decodes:
            start = s.request.num_computed_tokens
            place(s, start, start + 1, s.samples)
            decode_rows.append((s.request, start))
        for s, start, end in replays:
            for p in range(start, end):
                place(s, p, p + 1, s.samples and p == end - 1)
                decode_rows.append((s.request, p))
        q_starts = [0]
        for s, start, end in chunks:
            place(s, start, end, s.samples and end == s.request.num_computed_tokens + s.num_new_tokens)
            q_starts.append(q_starts[-1] + end - start)
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=dev)

        batch = ForwardBatch(
            input_ids=t(ids, torch.int64),
            positions=t(pos, torch.int64),
            slot_mapping=t(slots, torch.int64),
            num_decode_tokens=len(decode_rows),
            decode_block_tables=_table([r.block_ids for r, _ in decode_rows]).to(dev),
            decode_context_lens=t([p + 1 for _, p in decode_rows], torch.int32),
            prefill_block_tables=_table([s.request.block_ids for s, _, _ in chunks]).to(dev),
            prefill_query_start_loc=t(q_starts, torch.int32),
            prefill_context_lens=t([end for _, _, end in chunks], torch.int32),
            logits_indices=t(logits_rows + verify_rows + prompt_rows, torch.int64),
            prefill_fresh_kv=t([0 if s.spec_token_ids else 1 for s, _, _ in chunks], torch.int32),  # one per prefill part
        )
        return batch, sampled, spans, drafted

    def execute(self, out: SchedulerOutput) -> SampleResult:
        """Runs the step; returns the sampled token of each request whose
        prompt is done, and which of them failed (non-finite logits)."""
        batch, to_sample, spans, drafted = self.build_batch(out)
        if self.screen_greedy and to_sample and not spans and not drafted \
                and all(_plain_greedy(r) for r in to_sample) and hasattr(self.model, "greedy_tokens"):
            x = self.model.final_hidden(batch, self.kv.kv_pool)
            tokens = self.model.greedy_tokens(x)
            if tokens is not None:
                return SampleResult(dict(zip((r.request_id for r in to_sample), tokens)), {})
            return self._sample(self.model.logits(x), to_sample)
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
        result = self.sampler.sample_batch(logits, request_ids, params, [r.draw.seed for r in to_sample])
        if asked is not None:
            result = dataclasses.replace(result, logprobs=asked.score(result.token_ids))
        if any(r.draw.prompt_logprobs is not None for r in to_sample):
            # Their prompt is done this step: its logprobs leave with the first token.
            done = {r.request_id: list(r.prompt_logprobs) for r in to_sample
                    if r.draw.prompt_logprobs is not None and not r.output_token_ids}
            result = dataclasses.replace(result, prompt_logprobs=done)
        return result
