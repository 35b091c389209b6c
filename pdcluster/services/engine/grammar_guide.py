"""Grammar-constrained sampling on the batch: per request a matcher that
knows which tokens may come next; per step one bitmask for the rows that
have a grammar, applied once to the batch's logits; after the step each
accepted token advances its request's matcher.

    Sampler.sample_batch:
        logits -> penalties -> mask(rows with a grammar) -> argmax / draw -> accept(tokens)

    bitmask [N, ceil(vocab / 32)] int32, bit t of row r = token t may follow
    row r's output so far; rows without a grammar are neither filled nor applied.

A batch with no grammar row never reaches this module (the sampler checks
``any(p.guided ...)`` first), so unstructured traffic pays nothing.

Matchers are made at the first step a request is sampled, and caught up on
the tokens it already has: on a decode replica that is the first token the
prefill replica sampled under the same grammar (the spec travels in the
SamplingParams); after a failover, every token already sent.  Preemption
keeps the matcher: a recomputed request never re-samples a token.

A request is *done* when its grammar is complete: a stop token accepted, or
the output so far is a complete match after which only a stop token could
follow (then the engine ends it at once with finish_reason "stop", without
spending a step to sample EOS).  A grammar that is complete but may go on
(the regex ``a+``) lets the model choose: EOS, or more."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pdcluster.services.engine_errors import InvalidRequestReason
from pdcluster.services.engine.grammar import GrammarCache, xgrammar_module
from pdcluster.services.guided_spec import GuidedSpec
from pdcluster.services.engine.penalties import TokenHistory
from pdcluster.services.sampling_params import SamplingParams

NO_GRAMMARS = ("this engine has no grammar compiler bound (structured output is not set up on this "
               "replica): send the request without response_format / guided_*")


class GrammarGuide:
    def __init__(self, histories: Mapping[str, TokenHistory] | None = None):
        """``histories``: the live requests by id (the engine's table), read
        once per request to catch a new matcher up on its output so far."""
        self.histories: Mapping[str, TokenHistory] = histories if histories is not None else {}
        self.grammars: GrammarCache | None = None
        self._matchers: dict[str, Any] = {}
        self._done: set[str] = set()
        self._step_rows: list[str] = []          # this step's masked rows, in order
        self._step_failed: dict[str, str] = {}   # this step's rows that could not be masked, and why
        self._bitmask: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        # What the grammar costs, for the benchmark and the operator.
        self.num_masked_rows = 0
        self.mask_seconds = 0.0

    def bind(self, grammars: GrammarCache) -> None:
        """The engine's compiled-grammar cache (built over its tokenizer)."""
        self.grammars = grammars

    @staticmethod
    def wanted(params: Sequence[SamplingParams]) -> bool:
        return any(p.guided is not None for p in params)

    def is_done(self, request_id: str) -> bool:
        return request_id in self._done

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._done.discard(request_id)

    # ---- before argmax ------------------------------------------------------
    def mask(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
             ) -> torch.Tensor:
        """``logits`` with every disallowed token of a guided row at -inf.  A
        row whose matcher cannot be made is left as is and failed by ``accept``.

        In place, unless a row asked for logprobs: those are scored on the
        raw logits after sampling (runner.py, SampledLogprobs), so then the
        mask goes on a copy.  Nothing else reads the logits after the
        sampler, and the copy (3 MB at 16 rows) cost more than the mask
        itself on a memory-bound CPU."""
        started = time.perf_counter()
        self._step_rows, self._step_failed = [], {}
        bitmask = self._bitmask_for(len(params), logits.shape[-1])
        rows: list[int] = []
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if p.guided is None:
                continue
            matcher = self._matcher(rid, p.guided)
            if matcher is None:
                continue
            matcher.fill_next_token_bitmask(bitmask, row)
            rows.append(row)
            self._step_rows.append(rid)
        if rows:
            if any(p.logprobs is not None for p in params):
                logits = logits.clone()
            mask = bitmask[:len(params)].to(logits.device, non_blocking=True)
            xgrammar_module().apply_token_bitmask_inplace(logits, mask, indices=rows)
            if any(params[r].min_tokens for r in rows):
                _keep_grammar_alive(logits, bitmask, rows)
            self._fail_dead_ends(bitmask, rows, request_ids, params)
        self.num_masked_rows += len(rows)
        self.mask_seconds += time.perf_counter() - started
        return logits

    def _fail_dead_ends(self, bitmask: torch.Tensor, rows: list[int], request_ids: Sequence[str],
                        params: Sequence[SamplingParams]) -> None:
        """A row whose grammar allows no token at all (a pattern this model's
        vocabulary cannot spell on, e.g. a character with no byte token) is
        the request's fault: it fails with a 400-class reason.  (The bitmask
        has no bits past the vocabulary: xgrammar's TokenizerInfo is sized to it.)"""
        dead = (~bitmask[rows].any(dim=1)).tolist()
        for row, is_dead in zip(rows, dead):
            if is_dead:
                rid, spec = request_ids[row], params[row].guided
                history = self.histories.get(rid)
                n = len(history.output_token_ids) if history is not None else 0
                self._step_failed[rid] = InvalidRequestReason(
                    f"the {spec.kind} constraint allows no next token after {n} output tokens: this model's "
                    f"vocabulary cannot continue it; loosen the {spec.kind} or send the request without it")

    def _bitmask_for(self, num_rows: int, vocab: int) -> torch.Tensor:
        words = -(-vocab // 32)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != words:
            self._bitmask = torch.full((max(num_rows, 16), words), -1, dtype=torch.int32)
        return self._bitmask

    def _matcher(self, request_id: str, spec: GuidedSpec) -> Any | None:
        matcher = self._matchers.get(request_id)
        if matcher is not None:
            return matcher
        if self.grammars is None:
            self._step_failed[request_id] = NO_GRAMMARS
            return None
        history = self.histories.get(request_id)
        # Never compiled here (this runs inside a step): the request carries the
        # grammar admission compiled; a stand-in history without one reads the cache.
        compiled = getattr(history, "grammar", None)
        if compiled is None:
            compiled = self.grammars.get(spec)
        if compiled is None:
            self._step_failed[request_id] = (
                f"this request's {spec.kind} grammar was not compiled before it was scheduled (an internal error: "
                "admission compiles it); retry the request")
            return None
        matcher = xgrammar_module().GrammarMatcher(compiled)
        for i, token in enumerate(history.output_token_ids if history is not None else ()):
            if not matcher.accept_token(token):
                self._step_failed[request_id] = (
                    f"output token {i} (id {token}) does not match this request's grammar; it was sampled "
                    "without the grammar (a replica without structured output?): retry the request")
                return None
        self._matchers[request_id] = matcher
        return matcher

    # ---- after the choice ------------------------------------------------------
    def accept(self, result):
        """``result`` (a SampleResult) with each guided row's token accepted
        by its matcher; a row the grammar could not guide, or whose token it
        refuses, moves to ``failed``."""
        if not self._step_rows and not self._step_failed:
            return result
        tokens, failed = dict(result.token_ids), dict(result.failed)
        for rid, why in self._step_failed.items():
            tokens.pop(rid, None)
            failed[rid] = why   # over the sampler's own complaint (no valid probabilities): this is why
        for rid in self._step_rows:
            token = tokens.get(rid)
            if token is None or rid in self._step_failed:
                continue
            matcher = self._matchers[rid]
            if not matcher.accept_token(token):
                del tokens[rid]
                failed[rid] = (f"the sampled token {token} is not allowed by this request's grammar "
                               "(an internal error of the grammar mask); retry the request")
            elif matcher.is_terminated() or (matcher.is_completed() and self._only_stop_next(matcher)):
                self._done.add(rid)
        self._step_rows, self._step_failed = [], {}
        return dataclasses.replace(result, token_ids=tokens, failed=failed)

    def _only_stop_next(self, matcher: Any) -> bool:
        """Whether nothing but a stop token may follow (one mask fill; only
        asked when the output so far is already a complete match)."""
        words = self._bitmask.shape[1]  # mask() ran this step
        if self._scratch is None or self._scratch.shape[1] != words:
            self._scratch = torch.zeros((1, words), dtype=torch.int32)
        matcher.fill_next_token_bitmask(self._scratch, 0)
        allowed = allowed_token_ids(self._scratch[0])
        stops = set(self.grammars.stop_token_ids) if self.grammars is not None else set()
        return bool(allowed) and set(allowed) <= stops


def allowed_token_ids(bitmask_row: torch.Tensor) -> list[int]:
    """The token ids whose bit is set in one bitmask row (bit t of word t // 32)."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def _keep_grammar_alive(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """A row with nothing left after the mask (min_tokens masked the stop
    token the finished grammar needs) gets the grammar's own choices back at
    equal weight: the grammar wins over min_tokens, never an empty row."""
    dead = torch.isneginf(logits[rows]).all(dim=-1).tolist()
    for row, is_dead in zip(rows, dead):
        if is_dead:
            allowed = torch.tensor(allowed_token_ids(bitmask[row]), dtype=torch.long, device=logits.device)
            allowed = allowed[allowed < logits.shape[-1]]
            logits[row].index_fill_(0, allowed, 0.0)
