"""API keys on a real cluster: its own colocated cluster (one replica) with
one key in the config and one in PDCLUSTER_API_KEY (the config folds both
into the digests the gateway replica gets in its deployment args).
Without a right key every /v1 request is a 401 OpenAI body; with either key
the official openai client works unchanged, streaming too; /health stays
open; the state file holds digests, never a key.

Its config also names three tenants (issue 38) for the KV quota test: gold
keeps 20% of the replica's KV blocks whatever the others send, plain has no
guarantee, and flood fills the pool.  A small pool (32 MiB, 89 blocks of 16
tokens) so that the flood outgrows it in a few prompts."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import API_KEY_ENV, ClusterConfig, api_key_digest
from tests.integration.cluster.conftest import small_pool
from tests.integration.cluster.test_cluster_api import MODEL

pytestmark = pytest.mark.integration
CONFIG_KEY = "sk-cluster-config-0123456789abcdef"
ENV_KEY = "sk-cluster-env-fedcba9876543210"
WRONG = "sk-cluster-wrong-000000000000000"
GOLD, PLAIN, FLOOD = "sk-tenant-gold-0123456789abcd", "sk-tenant-plain-0123456789abc", "sk-tenant-flood-0123456789abc"
TENANTS = [{"name": "gold", "api_keys": [GOLD], "kv_guaranteed": 0.2}, {"name": "plain", "api_keys": [PLAIN]},
           {"name": "flood", "api_keys": [FLOOD]}]
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def authed_cluster(shared_ray):
    os.environ[API_KEY_ENV] = ENV_KEY  # read when the config is made: its digest joins the config's
    try:
        config = ClusterConfig(port=free_service_port(), mode="colocated",
                               colocated=small_pool(num_replicas=1, kv_cache_mib=32), api_keys=[CONFIG_KEY],
                               tenants=TENANTS)
    finally:
        os.environ.pop(API_KEY_ENV, None)
    with shared_ray.running(config) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(authed_cluster) -> str:
    return f"http://127.0.0.1:{authed_cluster.config.port}"


def oai(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.parametrize("headers", [{}, {"authorization": f"Bearer {WRONG}"}, {"authorization": CONFIG_KEY}],
                         ids=["no-key", "wrong-key", "malformed"])
def test_without_a_right_key_every_v1_request_is_refused(base_url, headers):
    for method, path, body in (("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})):
        r = httpx.request(method, f"{base_url}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"].startswith("Bearer") and r.headers["x-request-id"]
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_api_key", None)
        assert not any(k in r.text for k in (CONFIG_KEY, ENV_KEY, WRONG))


@pytest.mark.parametrize("key", [CONFIG_KEY, ENV_KEY], ids=["config-key", "env-key"])
def test_the_openai_client_with_a_right_key(base_url, key):
    with oai(base_url, key) as client:
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens >= 1
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time,", max_tokens=6,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_the_openai_client_with_a_wrong_key(base_url):
    with oai(base_url, WRONG) as client, pytest.raises(openai.AuthenticationError) as refused:
        list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True))
    assert refused.value.body["code"] == "invalid_api_key"


def test_health_stays_open(base_url):
    r = httpx.get(f"{base_url}/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_the_state_file_holds_digests_never_keys(authed_cluster):
    from pdcluster.services.cli.cluster_runtime import STATE_FILE

    text = STATE_FILE.read_text()
    assert CONFIG_KEY not in text and ENV_KEY not in text
    for key in (GOLD, PLAIN, FLOOD):
        assert key not in text
    assert set(authed_cluster.config.api_key_digests) == {api_key_digest(k)
                                                          for k in (CONFIG_KEY, ENV_KEY, GOLD, PLAIN, FLOOD)}
    assert api_key_digest(CONFIG_KEY) in text


def _completion(base_url: str, key: str, words: str) -> dict:
    r = httpx.post(f"{base_url}/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": MODEL, "prompt": words, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_a_tenant_with_a_kv_guarantee_keeps_its_prefix_while_another_fills_the_pool(base_url):
    """gold and plain each cache a ~200-token prompt; flood then sends about twice the pool in distinct
    prompts; gold's prompt is still cached (its 20%), plain's -- no guarantee, and released before the
    flood -- was evicted: the flood did fill the pool."""
    gold_prompt = " ".join(f"gold{i}" for i in range(70))
    plain_prompt = " ".join(f"plain{i}" for i in range(70))
    first = [_completion(base_url, key, p) for key, p in ((GOLD, gold_prompt), (PLAIN, plain_prompt))]
    assert all(128 <= u["prompt_tokens"] <= 272 for u in first), first  # within gold's 17 guaranteed blocks
    flooded = sum(_completion(base_url, FLOOD, " ".join(f"flood{n}x{i}" for i in range(150)))["prompt_tokens"]
                  for n in range(8))
    assert flooded > 2 * 89 * 16 * 0.9
    gold, plain = _completion(base_url, GOLD, gold_prompt), _completion(base_url, PLAIN, plain_prompt)
    assert _cached(gold) >= (first[0]["prompt_tokens"] // 16 - 1) * 16, gold
    assert _cached(plain) == 0, plain
