"""No internals in client errors (issue 33): a backend error's own text --
replica names, peer ids, endpoints, exception text, a password in a URL --
never reaches the client's body or SSE error event; the client is told the
cause and the fix, and the text goes to the log with the request id.  A
message its raiser wrote for the client (``for_client``) is told as is."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai_fakes import CHAT, FakeBackend, make_app, sse_events

from pdcluster.services.backend import (
    BackendError, BackendFailure, BackendInvalidRequest, BackendKVTransferFailed, BackendLeaseExpired,
    BackendOverloaded, BackendTimeout, BackendUnavailable, for_client,
)
from pdcluster.services.engine_errors import EngineDeadError, InvalidRequestError, RequestFailedError
from pdcluster.services.gateway.failover import FailoverReason, ReplicaLost, gave_up_message
from pdcluster.services.messages import TokenDelta
from pdcluster.services.openai.errors import client_message

C, CC = "/v1/completions", "/v1/chat/completions"
REPLICA = "decode-7f3e9a1c"
PEER = "nixl-agent-0xdeadbeef"
URL = "redis://:hunter2-secret@10.1.2.3:6379/0"
LEAKY = f"KV transfer from {REPLICA} failed: ConnectionResetError('{URL}') on peer {PEER}"
INTERNALS = (REPLICA, PEER, "hunter2-secret", "10.1.2.3", "ConnectionResetError", "redis://")

BACKEND_ERRORS = [
    (BackendFailure(LEAKY), 502, "replica_failed"),
    (BackendKVTransferFailed(LEAKY), 502, "replica_failed"),
    (BackendLeaseExpired(LEAKY), 503, "kv_lease_expired"),
    (BackendUnavailable(LEAKY), 503, "no_replica"),
    (BackendOverloaded(LEAKY, retry_after_s=2.0), 429, "overloaded"),
    (BackendTimeout(LEAKY), 504, "deadline_exceeded"),
    (BackendError(LEAKY), 500, "internal_error"),
]


def assert_no_internals(text: str) -> None:
    leaked = [s for s in INTERNALS if s in text]
    assert not leaked, (leaked, text)


@pytest.mark.parametrize("exc, status, code", BACKEND_ERRORS, ids=[type(e).__name__ for e, _, _ in BACKEND_ERRORS])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_backend_error_text_never_reaches_the_client(client, backend, caplog, exc, status, code, stream):
    backend.script.raise_before = exc
    with caplog.at_level(logging.INFO, logger="pdcluster.services.openai.errors"):
        r = await client.post(CC, json={"messages": CHAT, "stream": stream})
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert_no_internals(r.text)
    assert "retry" in r.json()["error"]["message"]          # the fix
    assert LEAKY in caplog.text and r.headers["x-request-id"] in caplog.text   # the detail, for the operator


class FailsAfterOneToken(FakeBackend):
    def __init__(self, exc: BaseException):
        super().__init__()
        self.exc = exc

    async def generate(self, request):
        yield TokenDelta([100], "Hello", None, num_prompt_tokens=len(request.prompt_token_ids))
        raise self.exc


@pytest.mark.parametrize("exc", [BackendFailure(LEAKY), BackendKVTransferFailed(LEAKY),
                                 ReplicaLost(FailoverReason.STREAM_BROKEN, LEAKY, REPLICA)])
async def test_a_mid_stream_error_event_has_no_internals(tokenizer, caplog, exc):
    app = make_app(FailsAfterOneToken(exc), tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        with caplog.at_level(logging.INFO, logger="pdcluster.services.openai.errors"):
            r = await c.post(CC, json={"messages": CHAT, "stream": True})
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "replica_failed"
    assert_no_internals(r.text)
    assert LEAKY in caplog.text


@pytest.mark.parametrize("exc, status", [(RequestFailedError(LEAKY), 502), (EngineDeadError(LEAKY), 503)])
async def test_an_in_process_engine_error_text_never_reaches_the_client(client, backend, exc, status):
    backend.script.raise_before = exc
    r = await client.post(C, json={"prompt": "Hi"})
    assert r.status_code == status
    assert_no_internals(r.text)


async def test_messages_written_for_the_client_are_told_as_they_are(client, backend):
    told = "the gateway is serving 64 requests (admission.max_in_flight = 64); retry shortly"
    backend.script.raise_before = for_client(BackendOverloaded(told, retry_after_s=1.0))
    r = await client.post(C, json={"prompt": "Hi"})
    assert r.status_code == 429 and r.json()["error"]["message"] == told and r.headers["retry-after"] == "1"
    # The engine's validators write theirs for the client: the field, its bound, the fix.
    backend.script.raise_before = InvalidRequestError("logit_bias names token id 99999, outside this model's "
                                                      "vocabulary [0, 49152)")
    r = await client.post(C, json={"prompt": "Hi"})
    assert r.status_code == 400 and "99999" in r.json()["error"]["message"]


def test_client_message_is_the_class_sentence_unless_marked():
    assert client_message(BackendInvalidRequest("max_tokens must be at least 1")) == "max_tokens must be at least 1"
    for exc, _, _ in BACKEND_ERRORS:
        assert_no_internals(client_message(exc))
    assert client_message(for_client(BackendFailure("the stream ended early; retry"))) == \
        "the stream ended early; retry"


def test_a_failover_that_gives_up_names_the_reasons_not_the_replicas():
    lost = ReplicaLost(FailoverReason.STREAM_BROKEN, LEAKY, REPLICA)
    message = gave_up_message(lost, "the stream lost its replica 3 times and max_failovers is 2: retry the request",
                              (f"replica_died@{REPLICA}", "stream_broken@decode-0a1b"))
    assert message.startswith("stream_broken: ") and "earlier: replica_died, stream_broken" in message
    assert_no_internals(message)
    assert "decode-0a1b" not in message
