"""The gateway's published schema, fuzzed against the live cluster with
schemathesis: a small budget of generated requests per endpoint, bodies the
schema allows and bodies it forbids, each asking for a few output tokens at
most.  None may be a 5xx or hang, every answer must conform to the schema,
and afterwards the cluster still answers a normal chat and holds no KV.

    pytest tests/integration/cluster/test_cluster_fuzz.py -q
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_schema_conformance, status_code_conformance,
)

from tests.integration.cluster.test_cluster_api import MODEL, wait_no_leaks

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 20           # per endpoint and mode
MAX_OUTPUT_TOKENS = 8
REQUEST_TIMEOUT_S = 60.0    # one request's answer, stream included; longer is a hang
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


def clamp_output(context: Any, body: Any) -> Any:
    """A ``map_body`` hook: at most MAX_OUTPUT_TOKENS of output, also when
    the body sets no cap (a chat's default is the rest of the context)."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_OUTPUT_TOKENS:
            body[key] = MAX_OUTPUT_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_OUTPUT_TOKENS
    return body


@pytest.fixture(scope="module")
def api_schema(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
    schema.hook("map_body")(clamp_output)
    return schema


def call_and_check(case, base_url: str) -> int:
    start = time.monotonic()
    response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)   # a hang raises ReadTimeout
    assert time.monotonic() - start < REQUEST_TIMEOUT_S
    case.validate_response(response, checks=CHECKS)
    return response.status_code


def fuzz(operation, mode: GenerationMode, base_url: str) -> set[int]:
    """MAX_EXAMPLES generated requests to ``operation``; the statuses they got."""
    seen: set[int] = set()

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        seen.add(call_and_check(case, base_url))

    run()
    return seen


def test_fuzzed_requests_are_never_5xx_nor_hang(api_schema, base_url, client, cluster):
    statuses: dict[str, set[int]] = {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            statuses[f"{path} {mode.value}"] = fuzz(api_schema[path]["POST"], mode, base_url)
    for path in ("/v1/models", "/health"):
        statuses[f"{path} GET"] = {call_and_check(api_schema[path]["GET"].Case(), base_url)}
    print("statuses seen:", statuses)
    assert all(s < 500 for seen in statuses.values() for s in seen), statuses

    # Nothing the fuzzer sent hurt the cluster: a plain chat still works, and no KV is left held.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert resp.choices[0].message.content and resp.usage.completion_tokens >= 1
    wait_no_leaks(cluster)
