"""logprobs, echo and n > 1 in the HTTP layer, over a scripted backend that
returns logprobs as the engine does: response shapes exactly as OpenAI's,
streamed and not; n choices fanned out after choice 0's first token, pinned
to its replica, each with its own seed; echo with max_tokens 0 scores the
prompt only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from openai_fakes import MODEL, make_app, sse_events

from pdcluster.services.backend import Backend
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.messages import GenerateRequest, TokenDelta
from pdcluster.services.token_logprob import TokenLogprob
from pdcluster.services.sampling_params import SamplingParams
from pdcluster.services.openai.choices import choice_seed, generate_choices

C, CC = "/v1/completions", "/v1/chat/completions"
ANSWER = " Hello world!"


class ScoredBackend(Backend):
    """Streams ANSWER one token per chunk with made-up logprobs (token i:
    -0.5 * (i + 1); alternatives: token ids 10, 11, ...)."""
    model_name, max_model_len = MODEL, 512

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.requests: list[GenerateRequest] = []
        self.closed: list[str] = []

    @staticmethod
    def entry(token_id: int, logprob: float, k: int) -> TokenLogprob:
        return TokenLogprob(token_id, logprob, tuple((10 + j, logprob - j - 1) for j in range(k)))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        p, done = request.params, False
        n = min(len(self.ids), p.max_tokens)
        try:
            for i in range(n):
                await asyncio.sleep(0)
                prompt = None
                k = request.draw.prompt_logprobs   # choice 0's alone (choices.py)
                if i == 0 and k is not None:
                    prompt = [self.entry(t, -1.0, k) for t in request.prompt_token_ids[1:]]
                lp = None if p.logprobs is None else [self.entry(self.ids[i], -0.5 * (i + 1), p.logprobs)]
                yield TokenDelta([self.ids[i]], self.tokenizer.decode([self.ids[i]]),
                                  ("stop" if n == len(self.ids) else "length") if i == n - 1 else None,
                                  num_prompt_tokens=len(request.prompt_token_ids),
                                  num_cached_tokens=16 if request.routing.prefer_worker else 0,
                                  logprobs=lp, prompt_logprobs=prompt, worker_name="prefill-w0" if i == 0 else "")
            done = True
        finally:
            if not done:
                self.closed.append(request.request_id)


@pytest.fixture
def scored(tokenizer) -> ScoredBackend:
    return ScoredBackend(tokenizer)


@pytest.fixture
async def api(scored, tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app(scored, tokenizer)),
                                 base_url="http://gateway") as c:
        yield c


MSGS = [{"role": "user", "content": "Say hello."}]


async def test_chat_logprobs_have_openais_shape(api, scored):
    r = await api.post(CC, json={"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [scored.tokenizer.decode([t]) for t in scored.ids]
    assert [c["logprob"] for c in content] == [-0.5, -1.0, -1.5][:len(content)]
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(first["bytes"]).decode() == first["token"]
    assert [set(t) for t in first["top_logprobs"]] == [{"token", "logprob", "bytes"}] * 2
    assert scored.requests[0].params.logprobs == 2 and scored.requests[0].params.prompt_logprobs is None


async def test_chat_without_logprobs_has_null_logprobs_and_asks_nothing(api, scored):
    r = await api.post(CC, json={"model": MODEL, "messages": MSGS})
    assert r.json()["choices"][0]["logprobs"] is None and scored.requests[0].params.logprobs is None


async def test_streamed_chat_chunks_carry_their_tokens_logprobs(api, scored):
    r = await api.post(CC, json={"model": MODEL, "messages": MSGS, "logprobs": True, "stream": True})
    chunks = [e for e in sse_events(r.text) if e != "[DONE]" and e["choices"]]
    scored_chunks = [c["choices"][0]["logprobs"]["content"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [len(c) for c in scored_chunks] == [1] * len(scored.ids)
    assert all(c[0]["top_logprobs"] == [] for c in scored_chunks)   # logprobs without top_logprobs: k = 0


async def test_completion_logprobs_have_openais_legacy_shape(api, scored):
    r = await api.post(C, json={"model": MODEL, "prompt": "Hi", "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    texts = [scored.tokenizer.decode([t]) for t in scored.ids]
    assert lp["tokens"] == texts and lp["token_logprobs"] == [-0.5, -1.0, -1.5][:len(texts)]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert lp["text_offset"] == offsets
    top = lp["top_logprobs"][0]
    assert isinstance(top, dict) and texts[0] in top and len(top) == 2   # k = 1 plus the chosen token


async def test_echo_with_max_tokens_0_scores_the_prompt_only(api, scored, tokenizer):
    prompt = "The quick brown fox"
    r = await api.post(C, json={"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    ids = tokenizer.encode(prompt)
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None] + [-1.0] * (len(ids) - 1)
    assert choice["logprobs"]["top_logprobs"][0] is None
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    sent = scored.requests[0].params
    assert sent.max_tokens == 1 and sent.prompt_logprobs == 0


async def test_echo_prefixes_text_and_logprobs_streamed_and_not(api, scored, tokenizer):
    body = {"model": MODEL, "prompt": "Hi there", "echo": True, "logprobs": 2, "max_tokens": 2}
    whole = (await api.post(C, json=body)).json()["choices"][0]
    events = [e for e in sse_events((await api.post(C, json=body | {"stream": True})).text) if e != "[DONE]"]
    streamed_text = "".join(e["choices"][0]["text"] for e in events)
    streamed_tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    streamed_offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert whole["text"].startswith("Hi there") and streamed_text == whole["text"]
    assert streamed_tokens == whole["logprobs"]["tokens"]
    assert streamed_offsets == whole["logprobs"]["text_offset"]
    assert len(whole["logprobs"]["tokens"]) == len(tokenizer.encode("Hi there")) + 2


async def test_n_choices_share_the_prompt_on_choice_0s_replica_with_their_own_seeds(api, scored):
    r = await api.post(C, json={"model": MODEL, "prompt": "Hi", "n": 3, "seed": 42, "temperature": 1.0})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == ANSWER for c in body["choices"])
    first, *rest = scored.requests
    assert first.routing.prefer_worker is None and first.params.seed == 42
    assert [q.routing.prefer_worker for q in rest] == ["prefill-w0"] * 2
    assert [q.draw.seed for q in rest] == [choice_seed(42, 1), choice_seed(42, 2)]
    assert all(q.params is first.params for q in rest)   # built once; each choice's seed is its draw
    assert len({q.request_id for q in scored.requests}) == 3
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(first.prompt_token_ids)
    assert usage["completion_tokens"] == 3 * len(scored.ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 16   # choices 1, 2 found the prompt cached


async def test_streamed_n_choices_are_indexed_and_each_ends(api, scored):
    r = await api.post(CC, json={"model": MODEL, "messages": MSGS, "n": 2, "stream": True,
                                 "stream_options": {"include_usage": True}})
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    by_index: dict[int, str] = {}
    finished = set()
    for e in events:
        for c in e["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + (c["delta"].get("content") or "")
            if c["finish_reason"]:
                finished.add(c["index"])
    assert by_index == {0: ANSWER, 1: ANSWER} and finished == {0, 1}
    assert events[-1]["usage"]["completion_tokens"] == 2 * len(scored.ids)


async def test_echoed_n_choices_ask_prompt_logprobs_of_choice_0_only(api, scored):
    r = await api.post(C, json={"model": MODEL, "prompt": "Hi there", "n": 2, "echo": True, "logprobs": 0})
    choices = r.json()["choices"]
    assert choices[0]["logprobs"]["token_logprobs"][:3] == choices[1]["logprobs"]["token_logprobs"][:3]
    assert [q.draw.prompt_logprobs for q in scored.requests] == [0, None]


async def test_closing_the_merged_stream_closes_every_choice(scored, tokenizer):
    request = GenerateRequest("req", tokenizer.encode("Hi"), SamplingParams(max_tokens=3), RoutingHeader((), 1))
    merged = generate_choices(scored.generate, request, 3)
    seen = [await anext(merged) for _ in range(2)]
    await merged.aclose()
    assert seen[0].index == 0
    assert set(scored.closed) == {"req", "req-1", "req-2"}   # each aborted, none left running


def test_choice_seeds_are_deterministic_distinct_and_64_bit():
    seeds = [choice_seed(7, i) for i in range(16)]
    assert seeds[0] == 7 and seeds == [choice_seed(7, i) for i in range(16)] and len(set(seeds)) == 16
    assert all(0 <= s < 2**64 for s in seeds[1:]) and choice_seed(-5, 3) != choice_seed(5, 3)
