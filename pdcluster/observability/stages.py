"""One request's stage spans and per-pool metrics, recorded where the stage
ran, so each deployment adds a handful of lines.  Spans are written after
the fact from timestamps (the engine's ``first_scheduled_s`` where the
RequestOutput carries it), so nothing is held open across an ``await`` or a
``yield``, and every stage hangs off ``gateway.request`` via the carrier.

    prefill replica  entered ──prefill.queue── first scheduled ──prefill.compute── first token
    decode replica   entered ──kv.transfer── pulled ──decode.queue── first scheduled
                     ──decode.generate── done
                     (kv.transfer includes waiting for free blocks: kv.reserve_wait_ms)
    both phases      entered ──prefill.queue── first scheduled ──prefill.compute── first token
    on one replica   ──decode.generate── done      (colocated mode, a decode replica's fallback;
                                                    the queue includes a peer prefix fetch)

Without ``first_scheduled_s`` on RequestOutput the queue spans fall back to
zero width (prefill) or end at the first output (decode).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


from pdcluster.observability import metrics, tracing as t
def _scheduled_s(out: Any) -> float | None:
    return getattr(out, "first_scheduled_s", None)


class _Stages:
    """``tags``: attributes every stage span carries (the request's tenant and priority)."""

    def __init__(self, carrier: Mapping[str, str], replica: str, block_size: int,
                 tags: Mapping[str, Any] | None = None):
        self.carrier, self.replica, self.block_size = carrier, replica, block_size
        self.tags = dict(tags or {})
        self.entered_s = time.monotonic()
        self._offset_ns = t.mono_offset_ns()  # one per request: touching stages share exact boundaries

    def _record(self, name: str, start_s: float, end_s: float, attrs: Mapping[str, Any] | None = None,
                error: BaseException | None = None) -> None:
        t.record_span(name, t.mono_to_ns(start_s, self._offset_ns), t.mono_to_ns(end_s, self._offset_ns),
                      self.carrier, {t.REPLICA: self.replica, **self.tags, **(attrs or {})}, error=error)


class PrefillStages(_Stages):
    """``stages = PrefillStages(request.trace_context, w.name, block_size)`` at
    entry; ``stages.done(last)`` after the engine's last output, or
    ``stages.failed(exc)``."""

    def done(self, out: Any) -> None:
        now = time.monotonic()
        scheduled = min(max(_scheduled_s(out) or self.entered_s, self.entered_s), now)
        self._record("prefill.queue", self.entered_s, scheduled)
        self._record("prefill.compute", scheduled, now, {
            t.PROMPT_TOKENS: out.num_prompt_tokens, t.CACHED_TOKENS: out.num_cached_tokens,
            t.CACHE_HIT_BLOCKS: out.num_cached_tokens // self.block_size,
            t.FINISH_REASON: out.finish_reason.value if out.finish_reason is not None else None})
        metrics.observe_queue("prefill", scheduled - self.entered_s)
        metrics.observe_ttft("prefill", now - self.entered_s)
        metrics.observe_e2e("prefill", now - self.entered_s)
        metrics.count_prompt_tokens("prefill", self.replica, out.num_prompt_tokens, out.num_cached_tokens)

    def failed(self, error: BaseException) -> None:
        self._record("prefill.compute", self.entered_s, time.monotonic(), error=error)


class WholeStages(_Stages):
    """Both phases on one replica's engine (``stream_whole_request``): spans only, the
    caller keeps its metrics.  ``stages = WholeStages(request.trace_context, w.name,
    block_size, tags)`` at entry, ``stages.on_output(out)`` per engine output,
    ``stages.finish(error)`` in ``finally``."""

    def __init__(self, carrier: Mapping[str, str], replica: str, block_size: int,
                 tags: Mapping[str, Any] | None = None):
        super().__init__(carrier, replica, block_size, tags)
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.prompt_attrs: dict[str, Any] = {}
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def on_output(self, out: Any) -> None:
        now = time.monotonic()
        if self.scheduled_s is None:
            self.scheduled_s = _scheduled_s(out)
        if not self.prompt_attrs:
            self.prompt_attrs = {t.PROMPT_TOKENS: out.num_prompt_tokens, t.CACHED_TOKENS: out.num_cached_tokens,
                                 t.CACHE_HIT_BLOCKS: out.num_cached_tokens // self.block_size}
        if out.new_token_ids and self.first_token_s is None:
            self.first_token_s = now
        self.num_tokens += len(out.new_token_ids)
        if out.finished:
            self.finished_s = now
            if out.finish_reason is not None:
                self.finish_reason = out.finish_reason.value

    def finish(self, error: BaseException | None = None) -> None:
        # Ends with the last token, not when the generator is closed (the gateway's span may end first);
        # a stream closed after its last token was served whole: not an error.
        if self.finished_s is not None:
            error = None
        now = self.finished_s if self.finished_s is not None else time.monotonic()
        scheduled = min(max(self.scheduled_s or now, self.entered_s), now)
        self._record("prefill.queue", self.entered_s, scheduled)
        if self.first_token_s is None:  # failed, or cancelled, before its first token
            self._record("prefill.compute", scheduled, now, self.prompt_attrs, error=error)
            return
        first = min(max(self.first_token_s, scheduled), now)
        self._record("prefill.compute", scheduled, first, self.prompt_attrs)
        self._record("decode.generate", first, now, {t.OUTPUT_TOKENS: self.num_tokens,
                                                     t.FINISH_REASON: self.finish_reason}, error=error)


class DecodeStages(_Stages):
    """At entry ``stages = DecodeStages(req.trace_context, w.name, block_size, w.transfer.name)``;
    ``stages.reserved()`` once blocks are reserved; ``stages.pulled(alloc,
    stats, n)`` after the pull; ``stages.on_output(out)`` per engine output;
    ``stages.finish(error)`` in ``finally``."""

    def __init__(self, carrier: Mapping[str, str], replica: str, block_size: int, backend: str,
                 tags: Mapping[str, Any] | None = None):
        super().__init__(carrier, replica, block_size, tags)
        self.backend = backend
        self.reserved_s: float | None = None
        self.pulled_s: float | None = None
        self.first_out_s: float | None = None
        self.scheduled_s: float | None = None
        self.timer = metrics.RequestTimer("decode", start_s=self.entered_s, clock=time.monotonic)
        self.finish_reason: str | None = None
        self.finished_s: float | None = None  # when the engine produced the last token
        self.drafted = self.accepted = 0

    def reserved(self) -> None:
        self.reserved_s = time.monotonic()

    def pulled(self, alloc: Any, stats: Any, num_blocks_pulled: int) -> None:
        self.pulled_s = time.monotonic()
        reserved = self.reserved_s or self.entered_s
        self._record("kv.transfer", self.entered_s, self.pulled_s, {
            "kv.backend": self.backend, t.KV_BYTES: stats.num_bytes, t.KV_SECONDS: stats.seconds,
            t.KV_GBPS: round(stats.gbytes_per_s, 3), t.KV_BLOCKS_PULLED: num_blocks_pulled,
            t.KV_BLOCKS_REUSED: alloc.num_cached_blocks,
            "kv.reserve_wait_ms": round((reserved - self.entered_s) * 1e3, 3)})
        metrics.count_transfer(self.backend, stats.num_bytes, stats.seconds)

    def on_output(self, out: Any) -> None:
        if self.first_out_s is None:
            self.first_out_s = time.monotonic()
            self.scheduled_s = _scheduled_s(out)
        self.timer.on_tokens(len(out.new_token_ids))
        if out.finished and out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value
        if out.finished:
            self.finished_s = time.monotonic()
        self.drafted = getattr(out, "num_draft_tokens", 0)            # running totals (spec_decode.py)
        self.accepted = getattr(out, "num_accepted_draft_tokens", 0)

    def finish(self, error: BaseException | None = None) -> None:
        # A finished decode's span ends with its last token, not when the generator is closed:
        # the gateway may end its own span (the parent) before the replica's ``finally`` runs.
        now = self.finished_s if error is None and self.finished_s is not None else time.monotonic()
        if self.pulled_s is None:  # failed (or was cancelled) before the KV arrived
            self._record("kv.transfer", self.entered_s, now, error=error)
            return
        start = self.pulled_s
        scheduled = min(max(self.scheduled_s or self.first_out_s or now, start), now)
        tpot_s = self.timer.tpot_s
        self._record("decode.queue", start, scheduled)
        self._record("decode.generate", scheduled, now, {
            t.OUTPUT_TOKENS: self.timer.num_tokens, t.FINISH_REASON: self.finish_reason,
            "decode.tpot_ms": round(tpot_s * 1e3, 3) if tpot_s is not None else None,
            "spec.draft_tokens": self.drafted or None, "spec.accepted_tokens": self.accepted or None,
            "spec.acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None},
            error=error)
        if error is None:
            metrics.observe_queue("decode", scheduled - start)
            self.timer.finish(ttft=False)  # the first token came from the prefill pool
