"""Log-probabilities of sampled tokens and of prompt tokens.

What is reported is the log-softmax of the model's *raw* logits: before
penalties, ``logit_bias``, ``min_tokens``, any grammar mask, temperature,
top-k and top-p.  That is the model's own distribution (what an evaluation
harness scores with, and what vLLM reports by default); the sampler's
adjusted distribution would change with every sampling knob.

Batched: the rows that asked are gathered into one ``[R, vocab]`` tensor and
go through one log_softmax, one gather (the chosen token), one topk (the
step's largest k) and one host transfer; each row then keeps its own k.  A
step in which no row asked never gets here (``SamplingParams.logprobs`` is
None for every row), so it costs nothing extra.

Prompt logprobs need the logits of every prompt position, not only the
last: the runner adds those positions to the forward's ``logits_indices``
for the requests that asked (``prompt_logprobs``), chunk by chunk::

    prompt     t0  t1  t2  t3 | t4  t5  t6          chunk 1 = positions 0..3, chunk 2 = 4..6
    logits at  p0  p1  p2  p3 | p4  p5  (p6 samples the first output token)
    scores     t1  t2  t3  t4 | t5  t6              entry j is token j+1's (t0 has none: null)

so a request's list grows by ``min(end, n - 1) - start`` entries per chunk,
and a preempted request (recomputed from position 0) starts it again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcluster.services.sampling_params import SamplingParams
from pdcluster.services.token_logprob import TokenLogprob

if TYPE_CHECKING:
    import torch   # imported where used (the engine's thread)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """Row i of ``logits`` (raw, [R, vocab]) scored at ``token_ids[i]``, with
    its ``ks[i]`` likeliest alternatives.  One op per step, not per row."""
    import torch

    if not len(token_ids):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k_max = max(ks)
    if k_max == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen)]
    top = torch.topk(logprobs, min(k_max, logprobs.shape[-1]), dim=-1)
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [TokenLogprob(t, lp, tuple(zip(top_ids[i][:k], top_values[i][:k])))
            for i, (t, lp, k) in enumerate(zip(token_ids, chosen, ks))]


class SampledLogprobs:
    """The log-softmax of one step's rows that asked for logprobs, taken
    from the raw logits *before* the sampler sees them (a penalty or mask
    applied in place afterwards cannot change it); scored once the sampled
    tokens are known."""

    def __init__(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]):
        import torch

        rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        self.request_ids = [request_ids[r] for r in rows]
        self.ks = [params[r].logprobs for r in rows]
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        self.logits = logits.index_select(0, index)   # a copy: in-place edits of ``logits`` cannot reach it

    @classmethod
    def of(cls, logits: torch.Tensor, request_ids: Sequence[str],
           params: Sequence[SamplingParams]) -> "SampledLogprobs | None":
        """None when no row asked: the step pays nothing."""
        if all(p.logprobs is None for p in params):
            return None
        return cls(logits, request_ids, params)

    def score(self, token_ids: dict[str, int]) -> dict[str, TokenLogprob]:
        """Each asking request's sampled token (failed rows have none) with its logprobs."""
        keep = [i for i, rid in enumerate(self.request_ids) if rid in token_ids]
        if not keep:
            return {}
        logits = self.logits if len(keep) == len(self.request_ids) else self.logits[keep]
        rids = [self.request_ids[i] for i in keep]
        scored = token_logprobs(logits, [token_ids[rid] for rid in rids], [self.ks[i] for i in keep])
        return dict(zip(rids, scored))


@dataclass(frozen=True)
class PromptSpan:
    """Positions ``[start, start + count)`` of one request's prompt whose
    logits this step computes for prompt logprobs (the step's extra logits
    rows hold the spans back to back, in order)."""
    request: object   # pdcluster.services.engine.request.Request (not imported: no cycle)
    start: int
    count: int


def prompt_span(request, start: int, end: int) -> PromptSpan | None:
    """The prompt-logprob positions of a chunk covering positions
    ``[start, end)``, or None if the request did not ask or has them all
    (a request that already has an output token never recomputes them)."""
    if request.draw.prompt_logprobs is None or request.output_token_ids:
        return None
    count = min(end, request.num_prompt_tokens - 1) - start
    return PromptSpan(request, start, count) if count > 0 else None


def record_prompt_logprobs(logits: torch.Tensor, spans: Sequence[PromptSpan]) -> None:
    """Scores each span's next prompt tokens (one batched op for the step)
    and stores them on its request (``Request.prompt_logprobs``)."""
    targets: list[int] = []
    ks: list[int] = []
    for s in spans:
        ids = s.request.prompt_token_ids
        targets.extend(ids[s.start + 1:s.start + 1 + s.count])
        ks.extend([s.request.draw.prompt_logprobs] * s.count)
    scored = token_logprobs(logits, targets, ks)
    done = 0
    for s in spans:
        kept = s.request.prompt_logprobs[:s.start]   # a recompute from 0 replaces what was there
        s.request.prompt_logprobs = kept + scored[done:done + s.count]
        done += s.count
