"""Schema-driven fuzzing of the HTTP layer: schemathesis generates requests
from the published /openapi.json -- bodies the schema allows (positive) and
bodies it forbids (negative) -- and sends them to the app with a
FakeBackend.  No input may be a 5xx; every answer must conform to the
document (a documented status, its content type, its body schema, each SSE
event's schema); every body the schema forbids must be a 4xx.

A failure prints the body as a curl command; replay it against
``make_app`` to debug."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openai_fakes import CHAT, MODEL, FakeBackend, make_app
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_schema_conformance, status_code_conformance,
)

from pdcluster.services.openai import create_app

SCHEMA = schemathesis.openapi.from_dict(create_app().openapi())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
EXAMPLES_PER_RUN = 250     # per endpoint and mode: ~3 s each
C, CC = "/v1/completions", "/v1/chat/completions"
TOK, DETOK = "/tokenize", "/detokenize"


@pytest.fixture(scope="module")
def fuzz_app(tokenizer):
    return make_app(FakeBackend(), tokenizer)


def call_and_check(app, case, seen: dict[int, str] | None = None) -> int:
    response = case.call(app=app, timeout=10)   # a hang is a ReadTimeout, not a stuck test
    case.validate_response(response, checks=CHECKS)
    if seen is not None:  # the first answer of each status, for a failure message
        seen.setdefault(response.status_code, response.text[:300])
    return response.status_code


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path", [C, CC, TOK, DETOK])
def test_fuzzed_bodies_are_never_5xx_and_conform(fuzz_app, path, mode):
    statuses: set[int] = set()
    seen: dict[int, str] = {}

    # derandomize: the same examples every run. The positive runs must reach the backend at least once,
    # and whether 250 random schema-valid bodies include one it accepts depends on the seed (seed 5 made
    # every chat body a 400/404): a fixed draw keeps that check from flipping with pytest's random seed.
    @settings(max_examples=EXAMPLES_PER_RUN, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(case=SCHEMA[path]["POST"].as_strategy(generation_mode=mode))
    def run(case):
        statuses.add(call_and_check(fuzz_app, case, seen))

    run()
    if mode is GenerationMode.NEGATIVE:
        assert all(400 <= s < 500 for s in statuses), statuses
    else:
        assert 200 in statuses, f"no fuzzed body reached the backend: {seen}"


# What random bodies rarely hit: the streamed and whole answers of both endpoints.
GOOD_BODIES = [
    (C, {"prompt": "Once upon a time", "max_tokens": 3}),
    (C, {"prompt": [1000, 1001, 1002], "stream": True, "stream_options": {"include_usage": True}}),
    (CC, {"messages": CHAT, "temperature": 1e-300, "top_p": 0.5, "top_k": -1, "seed": -(2**63)}),
    (CC, {"messages": CHAT, "stream": True, "stop": ["\n"] * 64, "stop_token_ids": list(range(256))}),
    (TOK, {"prompt": "Once upon a time", "return_token_strs": True}),
    (TOK, {"messages": CHAT, "add_generation_prompt": False, "add_special_tokens": True}),
    (DETOK, {"tokens": [1000, 1001, 1002]}),
]


@pytest.mark.parametrize("path, body", GOOD_BODIES)
def test_good_bodies_conform(fuzz_app, path, body):
    case = SCHEMA[path]["POST"].Case(body=body, media_type="application/json")
    assert call_and_check(fuzz_app, case) == 200


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics"])
def test_get_endpoints_conform(fuzz_app, path):
    assert call_and_check(fuzz_app, SCHEMA[path]["GET"].Case()) == 200


def test_fuzzed_model_ids_conform(fuzz_app):
    statuses: set[int] = set()

    @settings(max_examples=50, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=SCHEMA["/v1/models/{model_id}"]["GET"].as_strategy())
    def run(case):
        statuses.add(call_and_check(fuzz_app, case))

    run()
    assert statuses <= {404}, statuses
    served = SCHEMA["/v1/models/{model_id}"]["GET"].Case(path_parameters={"model_id": MODEL})
    assert call_and_check(fuzz_app, served) == 200


async def test_openapi_document_names_the_request_models(client):
    r = await client.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert set(doc["paths"]) == {"/health", "/live", "/ready", "/v1/models", "/v1/models/{model_id}", C, CC, TOK,
                                 DETOK, "/metrics"}
    for path, model in ((C, "CompletionRequest"), (CC, "ChatCompletionRequest")):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert {"200", "400", "413", "429", "503"} <= set(doc["paths"][path]["post"]["responses"])
    schemas = doc["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage", "ErrorResponse", "TokenizeCompletionRequest",
            "TokenizeChatRequest", "DetokenizeRequest"} <= set(schemas)
    tokenize_body = doc["paths"][TOK]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert tokenize_body == {"anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                                       {"$ref": "#/components/schemas/TokenizeChatRequest"}]}
    assert "422" not in doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    temperature = schemas["CompletionRequest"]["properties"]["temperature"]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    assert schemas["ChatCompletionRequest"]["properties"]["stop"]["anyOf"][1]["maxItems"] == 64


def test_a_stream_failing_midway_conforms(tokenizer):
    backend = FakeBackend()
    backend.script.fail_at = 2      # an error event, then [DONE]
    case = SCHEMA[CC]["POST"].Case(body={"messages": CHAT, "stream": True}, media_type="application/json")
    assert call_and_check(make_app(backend, tokenizer), case) == 200
