"""Next-token choice per request: greedy, or temperature / top-k / top-p
sampling with a per-request seeded generator, after the request's penalties,
``logit_bias`` and ``min_tokens`` (penalties.py) have changed its logits.

A row whose logits are not finite (NaN or inf out of the forward pass), or
whose probabilities are not after temperature / top-k / top-p, fails that
request alone; the other rows of the batch are sampled as usual.  Finiteness
is read off the model's raw logits (the -inf that min_tokens writes is on
purpose) in the same pass as each row's argmax (``ops.argmax_rows``: one
native pass on the CPU); a batch without penalties or a grammar needs no
other pass for its greedy rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pdcluster.kernels import ops
from pdcluster.services.engine.categorical import draw
from pdcluster.services.engine_errors import RequestFailedError
from pdcluster.services.engine.grammar_guide import GrammarGuide
from pdcluster.services.engine.logprobs import token_logprobs
from pdcluster.services.token_logprob import TokenLogprob
from pdcluster.services.engine.penalties import Penalties, TokenHistory
from pdcluster.services.engine.random_stream import position_seed
from pdcluster.services.sampling_params import SamplingParams
from pdcluster.services.engine.spec_decode import emitted_tokens, verify_sampled

NONFINITE_LOGITS = ("numerical error in this request's logits (NaN or inf out of the model); "
                    "the engine and other requests are unaffected: retry")


@dataclass(frozen=True)
class SampleResult:
    """One step's choices: a token per healthy row, and per failed row why
    it failed (the message of the RequestFailedError its caller will get)."""
    token_ids: dict[str, int]
    failed: dict[str, str]
    # Rows that asked (SamplingParams.logprobs): the sampled token's logprobs (the runner fills it in).
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # Rows that asked prompt_logprobs and sampled their first token: the prompt's (entry j = token j+1).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Drafted rows (spec_decode.py): every token the step emits, in order; not in token_ids.
    verified: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)

    def merged(self, other: "SampleResult") -> "SampleResult":
        """This step's sampled rows and ``other``'s (disjoint requests) as one result."""
        return SampleResult({**self.token_ids, **other.token_ids}, {**self.failed, **other.failed},
                            {**self.logprobs, **other.logprobs}, {**self.prompt_logprobs, **other.prompt_logprobs},
                            {**self.verified, **other.verified}, {**self.verified_logprobs, **other.verified_logprobs})


class _NoProbabilities(Exception):
    pass


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = (), histories: Mapping[str, TokenHistory] | None = None):
        """``eos_token_ids``: what min_tokens masks besides stop_token_ids;
        ``histories``: each live request's tokens by id, read only for the
        rows with penalties (the engine passes its request table)."""
        self._generators: dict[str, torch.Generator] = {}
        self.penalties = Penalties(eos_token_ids, histories)
        self.grammar = GrammarGuide(histories)  # structured output; the engine binds its grammar cache

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.penalties.forget(request_id)
        self.grammar.forget(request_id)

    def _generator(self, request_id: str, seed: int | None, device: torch.device,
                   position: int) -> torch.Generator:
        """The request's generator, ready for the draw of output token
        ``position``.  Seeded: reseeded from (seed, position) before every
        draw (random_stream.py), so a request resumed on another replica
        draws what the original would have.  Unseeded: one OS-seeded stream."""
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator(device=device)  # the draw wants it where the probabilities are
            if seed is None:
                g.seed()
            self._generators[request_id] = g
        if seed is not None:
            g.manual_seed(position_seed(seed, position))
        return g

    def _output_position(self, request_id: str) -> int:
        """How many output tokens the request has (a resumed one counts those
        sent before the hop): the position of the token drawn now."""
        history = self.penalties.histories.get(request_id)
        return len(history.output_token_ids) if history is not None else 0

    def sample_batch(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
                     seeds: Sequence[int | None] | None = None) -> SampleResult:
        """``logits``: fp32 [N, vocab], one row per request; ``seeds``: each row's
        (its stream's draw, StreamDraw), else its params'."""
        # The raw rows' finiteness, and their greedy choice when nothing below changes them.
        best, finite = ops.argmax_rows(logits)
        adjusts = any(p.adjusts_logits for p in params)
        if adjusts:
            logits = self.penalties.apply(logits, request_ids, params)
        guided = GrammarGuide.wanted(params)  # after penalties, before the choice; False costs nothing
        if guided:
            logits = self.grammar.mask(logits, request_ids, params)
        if adjusts or guided:
            best, _ = ops.argmax_rows(logits)  # masked tokens are -inf here: finiteness is the raw rows'
        # -1 marks a non-finite row (argmax of a NaN row is a garbage token)
        best = [b if ok else -1 for b, ok in zip(best, finite)]
        if all(p.greedy for p in params) and min(best, default=0) >= 0:
            result = SampleResult(dict(zip(request_ids, best)), {})
            return self.grammar.accept(result) if guided else result
        tokens: dict[str, int] = {}
        failed: dict[str, str] = {}
        seeds = [p.seed for p in params] if seeds is None else seeds
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if best[row] < 0:
                failed[rid] = NONFINITE_LOGITS
            elif p.greedy:
                tokens[rid] = best[row]
            else:
                token = self._draw(logits[row], rid, p, seeds[row])
                if isinstance(token, str):
                    failed[rid] = token
                else:
                    tokens[rid] = token
        result = SampleResult(tokens, failed)
        return self.grammar.accept(result) if guided else result

    def _draw(self, row: torch.Tensor, request_id: str, p: SamplingParams, seed: int | None) -> int | str:
        """A sampled token, or why none could be drawn."""
        why = (f"numerical error sampling this request (temperature={p.temperature!r}, top_p={p.top_p!r}, "
               f"top_k={p.top_k}) gave no valid probabilities; retry, or use temperature 0")
        try:
            probs = probabilities(row, p)
            g = self._generator(request_id, seed, row.device, self._output_position(request_id))
            token = draw(probs, g)
            return why if token is None else token
        except RuntimeError as exc:  # a generator that will not seed
            return f"{why} ({exc})"

    def verify_batch(self, logits: torch.Tensor, drafted: Sequence) -> SampleResult:
        """Checks each drafted step (scheduler.ScheduledRequest with
        ``spec_token_ids``) against its k+1 rows of raw ``logits``, back to
        back in ``drafted``'s order.  Drafted requests have no penalties and
        no grammar (spec_decode.speculates), so the raw logits are the
        sampler's; one argmax pass for all greedy rows."""
        best, finite = ops.argmax_rows(logits)
        best = [b if ok else -1 for b, ok in zip(best, finite)]
        verified: dict[str, list[int]] = {}
        failed: dict[str, str] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        row = 0
        for s in drafted:
            req, n = s.request, s.num_new_tokens
            rid, p = req.request_id, req.params
            if min(best[row:row + n]) < 0:
                failed[rid] = NONFINITE_LOGITS
            elif p.greedy:
                verified[rid] = emitted_tokens(best[row:row + n], s.spec_token_ids)
            else:
                tokens = self._verify_draws(logits[row:row + n], rid, p, req.draw.seed, s.spec_token_ids)
                if isinstance(tokens, str):
                    failed[rid] = tokens
                else:
                    verified[rid] = tokens
            if p.logprobs is not None and rid in verified:
                got = verified[rid]
                logprobs[rid] = token_logprobs(logits[row:row + len(got)], got, [p.logprobs] * len(got))
            row += n
        return SampleResult({}, failed, verified=verified, verified_logprobs=logprobs)

    def _verify_draws(self, rows: torch.Tensor, request_id: str, p: SamplingParams, seed: int | None,
                      draft: list[int]) -> list[int] | str:
        """Point-mass rejection sampling of one draft (spec_decode.verify_sampled),
        each draw from the generator of its own output position."""
        why = (f"numerical error sampling this request (temperature={p.temperature!r}, top_p={p.top_p!r}, "
               f"top_k={p.top_k}) gave no valid probabilities; retry, or use temperature 0")
        first = self._output_position(request_id)

        def probs(j: int) -> torch.Tensor:
            pj = probabilities(rows[j], p)
            if not bool(torch.isfinite(pj).all()) or not float(pj.sum()) > 0:
                raise _NoProbabilities
            return pj

        try:
            return verify_sampled(probs, draft, lambda j: self._generator(request_id, seed, rows.device, first + j))
        except _NoProbabilities:
            return why
        except RuntimeError as exc:
            return f"{why} ({exc})"

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """One token per row, in row order; RequestFailedError if any row failed
        (the engine uses ``sample_batch``, which fails only that row)."""
        result = self.sample_batch(logits, request_ids, params)
        if result.failed:
            rid, why = next(iter(result.failed.items()))
            raise RequestFailedError(f"request {rid!r}: {why}")
        return [result.token_ids[rid] for rid in request_ids]


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted to top-k, then to the
    smallest set whose mass reaches top-p (always keeping the best token)."""
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        keep = torch.topk(x, p.top_k).indices  # exactly k, even when logits tie
        x = torch.full_like(x, float("-inf")).scatter(0, keep, x[keep])
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, stable=True)  # ties in argmax's order
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= p.top_p  # mass before this token already enough
        # The best token always stays: a denormal top_p rounds to 0 in fp32, and
        # 0 >= 0 would drop every token and leave nothing to sample.
        drop[0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    return torch.softmax(x, dim=-1)
