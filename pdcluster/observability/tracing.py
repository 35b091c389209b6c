"""OpenTelemetry tracing for every pdcluster process, and the few helpers the
deployments use to open spans and carry W3C trace context across Ray calls.

One request is one trace; the stage spans hang directly off the root:

    gateway.request                     gateway  (continues an incoming traceparent)
    ├─ router.route    pool=prefill     gateway  (the Serve router's loop)
    ├─ prefill.queue                    prefill replica
    ├─ prefill.compute                  prefill replica
    ├─ router.route    pool=decode      gateway
    ├─ kv.transfer                      decode replica
    ├─ decode.queue                     decode replica
    └─ decode.generate                  decode replica

Where one replica runs both phases (colocated mode, a decode replica's
fallback) it records prefill.queue, prefill.compute and decode.generate.

Exporters (``setup_tracing`` reads the standard variables once per process):

    OTEL_SDK_DISABLED=true              no tracing at all (also PDCLUSTER_TRACING=0)
    OTEL_TRACES_EXPORTER=otlp[,console] OTLP per OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL
                                        (http/protobuf default, or grpc) and _ENDPOINT
    OTEL_TRACES_EXPORTER=none           no exporter, not even the JSONL file
    OTEL_TRACES_SAMPLER[_ARG]           honoured by the SDK (default: parent-based, always on)
    PDCLUSTER_TRACE_FILE=path|off       the local JSONL file (default runs/traces/spans.jsonl)
    PDCLUSTER_TRACE_FILE_MAX_BYTES/_KEEP  its size cap and rotated files kept (span_file.py)
    PDCLUSTER_TRACE_TEXT=1              allow prompt/completion text in attributes

Prompt and completion text never leaves the process unless record_text is on:
``drop_text`` removes such attributes in every helper here and again in the
JSONL exporter.  Without ``setup_tracing`` every helper still works and costs
next to nothing (OpenTelemetry's non-recording spans), so unit tests and the
bare engine need nothing.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

log = logging.getLogger("pdcluster.telemetry")

TRACE_FILE_ENV = "PDCLUSTER_TRACE_FILE"
TRACE_TEXT_ENV = "PDCLUSTER_TRACE_TEXT"
TRACING_ENV = "PDCLUSTER_TRACING"
# Absolute, so replicas whose cwd differs from the driver's write the same file.
DEFAULT_TRACE_FILE = Path(__file__).resolve().parents[2] / "runs" / "traces" / "spans.jsonl"
TRACE_ID_HEADER = "x-trace-id"
JSONL_SCHEDULE_DELAY_MS = 100  # short: `pdcluster trace --last` right after a request sees it
JSONL_MAX_QUEUE = 8192         # spans; a burst of ~1000 requests finishing at once fits (default 2048)

# Attribute keys shared by the wiring and `pdcluster trace`.
REQUEST_ID = "request.id"             # the x-request-id the client sees
ENGINE_ID = "request.engine_id"       # the id the replicas use, when it differs
REPLICA = "replica"
POOL = "pool"
PROMPT_TOKENS = "prompt.tokens"
CACHED_TOKENS = "prompt.cached_tokens"
CACHE_HIT_BLOCKS = "cache.hit_blocks"
OUTPUT_TOKENS = "output.tokens"
FINISH_REASON = "finish_reason"
POLICY = "router.policy"
ROUTE_REASON = "router.reason"
KV_BYTES = "kv.bytes"
KV_SECONDS = "kv.seconds"
KV_GBPS = "kv.gbps"
KV_BLOCKS_PULLED = "kv.blocks_pulled"
KV_BLOCKS_REUSED = "kv.blocks_reused"

_TEXT_LAST_SEGMENTS = frozenset({"text", "prompt", "completion", "content", "messages", "delta", "text_delta"})
_TEXT_PREFIXES = ("gen_ai.prompt", "gen_ai.completion", "gen_ai.input.messages", "gen_ai.output.messages")


class _State:
    configured = False                 # setup_tracing ran (enabled or not)
    provider: Any = None               # the SDK TracerProvider, None when disabled
    tracer: trace.Tracer | None = None
    record_text = False


_state = _State()


def _env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value in ("1", "true", "yes", "on")


def is_text_attribute(key: str) -> bool:
    """Keys that may hold prompt or completion text: ``prompt``, ``prompt.text``,
    ``gen_ai.prompt.0.content``... but not ``prompt.tokens``."""
    return key.rsplit(".", 1)[-1] in _TEXT_LAST_SEGMENTS or key.startswith(_TEXT_PREFIXES)


def drop_text(attrs: Mapping[str, Any] | None, record_text: bool | None = None) -> dict[str, Any]:
    """``attrs`` without text-bearing keys (unless text recording is on) and
    without None values (OpenTelemetry rejects them)."""
    keep_text = _state.record_text if record_text is None else record_text
    return {k: v for k, v in (attrs or {}).items()
            if v is not None and (keep_text or not is_text_attribute(k))}


def setup_tracing(service_name: str, jsonl_path: str | Path | None = None, enabled: bool = True, *,
                  instance: str | None = None, record_text: bool | None = None,
                  set_global: bool = False) -> bool:
    """Configures this process's tracer once (later calls are no-ops) and
    returns whether spans are recorded.  ``service_name`` e.g.
    "pdcluster-gateway"; ``instance`` names the replica.

    The provider stays private unless ``set_global``: FastAPI (0.165 here)
    traces every request itself once a global provider exists, and its server
    span would be a second root beside ``gateway.request``."""
    if _state.configured:
        return _state.provider is not None
    _state.configured = True
    _state.record_text = _env_flag(TRACE_TEXT_ENV) if record_text is None else record_text
    # Disabled: an explicit no-op tracer, even if another library set a global provider.
    _state.tracer = trace.NoOpTracer()
    if not enabled or _env_flag("OTEL_SDK_DISABLED") or not _env_flag(TRACING_ENV, default=True):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from pdcluster.observability.exporters import build_processors

    path = jsonl_path if jsonl_path is not None else os.environ.get(TRACE_FILE_ENV, str(DEFAULT_TRACE_FILE))
    processors = build_processors(service_name, path, drop_text, JSONL_MAX_QUEUE, JSONL_SCHEDULE_DELAY_MS)
    if not processors:
        return False
    resource = Resource.create({"service.name": service_name, "process.pid": os.getpid(),
                                "service.instance.id": instance or f"{socket.gethostname()}:{os.getpid()}"})
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
    for p in processors:
        provider.add_span_processor(p)
    if set_global and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    _state.provider, _state.tracer = provider, provider.get_tracer("pdcluster")
    return True


def shutdown_tracing() -> None:
    """Flushes and closes the exporters (the SDK also does it at exit)."""
    if _state.provider is not None:
        _state.provider.shutdown()


def force_flush(timeout_millis: int = 5000) -> bool:
    return _state.provider.force_flush(timeout_millis) if _state.provider is not None else True


def _reset_for_tests() -> None:
    shutdown_tracing()
    _state.configured, _state.provider, _state.tracer, _state.record_text = False, None, None, False


def tracer() -> trace.Tracer:
    return _state.tracer or trace.get_tracer("pdcluster")


# ---- context propagation ------------------------------------------------------
def inject(span: Span | None = None) -> dict[str, str]:
    """The W3C carrier (``traceparent``, ...) of ``span`` or the current context."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The context a carrier (or HTTP headers) describes; empty if none."""
    return propagate.extract(carrier or {})


def _parent(carrier: Mapping[str, str] | None) -> Context | None:
    # An empty carrier means "nobody told us": stay in the current context
    # rather than starting a new trace.
    return extract(carrier) if carrier else None


def carrier_of(args: Sequence[Any]) -> dict[str, str] | None:
    """The ``trace_context`` of a call's message (its first argument: the
    Serve router sees the GenerateRequest only as an argument)."""
    carrier = getattr(args[0], "trace_context", None) if args else None
    return dict(carrier) if isinstance(carrier, Mapping) and carrier else None


def trace_id_hex(span: Span | None = None) -> str | None:
    """The 32-hex trace id of ``span`` (default: the current one), None outside a trace."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def mono_offset_ns() -> int:
    """Epoch ns minus monotonic ns, now.  Read it once per request and pass it
    to ``mono_to_ns`` so that stages which touch share one boundary exactly
    (two readings differ by the jitter between the two clock calls)."""
    return time.time_ns() - time.monotonic_ns()


def mono_to_ns(monotonic_s: float, offset_ns: int | None = None) -> int:
    """A ``time.monotonic()`` reading (the engine's clock) as epoch ns, the
    clock spans use.  Only valid in the process that read it."""
    return int(monotonic_s * 1e9) + (mono_offset_ns() if offset_ns is None else offset_ns)


# ---- spans --------------------------------------------------------------------
def start_span(name: str, carrier: Mapping[str, str] | None = None, attrs: Mapping[str, Any] | None = None,
               *, start_ns: int | None = None, kind: trace.SpanKind = trace.SpanKind.INTERNAL) -> Span:
    """A started span that is *not* made current; end it with ``end_span``.
    For spans that outlive one block (a streamed response)."""
    return tracer().start_span(name, context=_parent(carrier), kind=kind, attributes=drop_text(attrs),
                               start_time=start_ns, record_exception=False, set_status_on_exception=False)


def end_span(span: Span, error: BaseException | None = None, *, end_ns: int | None = None) -> None:
    """Records ``error`` (an exception: ERROR status; a cancellation: the
    ``cancelled`` attribute, since a client leaving is no server fault) and ends."""
    if error is not None and span.is_recording():
        if isinstance(error, Exception):
            span.record_exception(error)
            span.set_attribute("error.type", type(error).__qualname__)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:500]))
        else:  # CancelledError, GeneratorExit, KeyboardInterrupt
            span.set_attribute("cancelled", True)
    span.end(end_time=end_ns)


def record_span(name: str, start_ns: int, end_ns: int, carrier: Mapping[str, str] | None = None,
                attrs: Mapping[str, Any] | None = None, *, error: BaseException | None = None) -> None:
    """A span for a stage that already happened (queue waits measured by the engine)."""
    end_span(start_span(name, carrier, attrs, start_ns=start_ns), error, end_ns=max(start_ns, end_ns))


def set_attrs(attrs: Mapping[str, Any] | None = None, /, *, span: Span | None = None, **kw: Any) -> None:
    """Sets attributes on ``span`` (default: the current span), text dropped."""
    target = span or trace.get_current_span()
    if target.is_recording():
        target.set_attributes(drop_text({**(attrs or {}), **kw}))


@contextmanager
def _scope(name: str, carrier: Mapping[str, str] | None, attrs: Mapping[str, Any] | None) -> Iterator[Span]:
    s = start_span(name, carrier, attrs)
    token = otel_context.attach(trace.set_span_in_context(s))
    error: BaseException | None = None
    try:
        yield s
    except BaseException as exc:
        error = exc
        raise
    finally:
        otel_context.detach(token)
        end_span(s, error)


class span:
    """``with span("kv.transfer", req.trace_context, {KV_BYTES: n}) as s:`` --
    the span is current inside the block, so nested spans and ``set_attrs``
    find it.  Also a decorator for sync and async functions (parent: the
    caller's context).  Don't hold it open across an async generator's
    ``yield``: the consumer may resume it in another task's context."""

    def __init__(self, name: str, carrier: Mapping[str, str] | None = None,
                 attrs: Mapping[str, Any] | None = None, **kw: Any):
        self.name, self.carrier, self.attrs = name, carrier, {**(attrs or {}), **kw}
        self._cm: Any = None

    def __enter__(self) -> Span:
        self._cm = _scope(self.name, self.carrier, self.attrs)
        return self._cm.__enter__()

    def __exit__(self, *exc_info: Any) -> bool:
        cm, self._cm = self._cm, None
        return bool(cm.__exit__(*exc_info))

    def __call__(self, fn: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with _scope(self.name, self.carrier, self.attrs):
                    return await fn(*args, **kwargs)
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _scope(self.name, self.carrier, self.attrs):
                return fn(*args, **kwargs)
        return wrapper


def replica_env() -> dict[str, str]:
    """The tracing variables of this (driver) process, for a deployment's
    ``runtime_env={"env_vars": ...}``: replicas then export where the driver
    would, even on a Ray cluster started elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if k.startswith("OTEL_") or k in (TRACE_TEXT_ENV, TRACING_ENV)}
    path = os.environ.get(TRACE_FILE_ENV, str(DEFAULT_TRACE_FILE))
    env[TRACE_FILE_ENV] = path if path.strip().lower() in ("", "off", "none") else str(Path(path).resolve())
    return env
