"""A request's SamplingParams are built once (issue 39): counted by instrumenting the
constructor while requests go through the HTTP layer and what the gateway does to them on
the way to a replica -- n choices, a gateway-drawn seed (gateway/resume.py
``with_stream_seed``) and a failover's resume (``resume_request``).  What differs per
stream (a choice's seed, choice 0 alone reporting prompt logprobs) travels beside the
params as ``GenerateRequest.draw``; the engine's side of it is in
tests/unit/engine/test_stream_draw.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from openai_fakes import CHAT, MODEL, FakeBackend, make_app

from pdcluster.services.sampling_params import SamplingParams
from pdcluster.services.gateway.resume import StreamProgress, resume_request, with_stream_seed
from pdcluster.services.messages import GenerateRequest, TokenDelta
from pdcluster.services.openai.choices import choice_seed


class GatewayPathBackend(FakeBackend):
    """The fake's answer, after the gateway's own steps: a seed drawn for an unseeded
    sampled stream, then the request a failover after the first token would send."""

    def __init__(self) -> None:
        super().__init__()
        self.resumed: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        request = with_stream_seed(request)
        progress = StreamProgress(len(request.prompt_token_ids), request.params.max_tokens)
        async for chunk in super().generate(request):
            if not progress.token_ids:   # lost after its first token: the resume a failover sends
                progress.add(chunk)
                progress.failed_over("replica died", "w0", avoid=True)
                self.resumed.append(resume_request(request, progress))
            yield chunk


@pytest.fixture
def built(monkeypatch) -> list[SamplingParams]:
    """Every SamplingParams constructed (dataclasses.replace included) from now on."""
    made: list[SamplingParams] = []
    original = SamplingParams.__post_init__

    def counting(self: SamplingParams) -> None:
        made.append(self)
        original(self)

    monkeypatch.setattr(SamplingParams, "__post_init__", counting)
    return made


@pytest.fixture
async def api(tokenizer) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayPathBackend]]:
    backend = GatewayPathBackend()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app(backend, tokenizer)),
                                 base_url="http://gateway") as client:
        yield client, backend


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT, "n": 3, "temperature": 0.9}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "seed": 7, "response_format": JSON_SCHEMA}),
    ("/v1/completions", {"prompt": "Hi there", "n": 2, "seed": 5, "echo": True, "logprobs": 2, "max_tokens": 3}),
    ("/v1/completions", {"prompt": "Hi there", "temperature": 0, "min_tokens": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "n": 2, "temperature": 1.0}),
])
async def test_one_sampling_params_per_request_through_choices_seeds_and_failover(api, built, path, body):
    client, backend = api
    r = await client.post(path, json={"model": MODEL} | body)
    assert r.status_code == 200, r.text
    n = body.get("n", 1)
    assert len(built) == 1, [p for p in built]
    assert len(backend.requests) == n and len(backend.resumed) == n
    [params] = built
    assert all(q.params is params for q in backend.requests + backend.resumed)  # the same object everywhere
    seeds = [q.draw.seed for q in backend.requests]
    if params.greedy:
        assert seeds == [None] * n
    else:
        assert None not in seeds and len(set(seeds)) == n   # every sampled stream draws its own
    if params.seed is not None:
        assert seeds == [choice_seed(params.seed, i) for i in range(n)]
    # a resume draws what the stream it continues would have drawn
    assert [q.draw for q in backend.resumed] == [q.draw for q in backend.requests]
    # prompt logprobs: choice 0 only
    asked = params.prompt_logprobs
    assert [q.draw.prompt_logprobs for q in backend.requests] == [asked] + [None] * (n - 1)


async def test_a_bad_value_is_refused_before_any_params_are_built(api, built):
    client, backend = api
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert built == [] and backend.requests == []
