"""/tokenize, /detokenize and /v1/models/{model_id} over httpx's ASGI
transport with the real SmolLM2 tokenizer: vLLM's shapes, ids equal to what
generation uses, round trips, OpenAI error bodies, API keys."""

from __future__ import annotations

import threading

import httpx
import pytest
from openai_fakes import CHAT, MAX_BODY_BYTES, MODEL, FakeBackend, assert_openai_error, make_app

from pdcluster.services.config import api_key_digest
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.openai.prompt import OFF_LOOP_PROMPT_SIZE, longest_token_chars

TEXT = "Once upon a time, in a land far away, there lived a tokenizer."


async def test_tokenize_a_prompt_round_trips_through_detokenize(client, backend, tokenizer):
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": len(tokenizer.encode(TEXT)), "max_model_len": backend.max_model_len,
                    "tokens": tokenizer.encode(TEXT)}
    r = await client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}


async def test_tokenize_ids_are_the_ids_completions_generate_from(client, backend):
    tokens = (await client.post("/tokenize", json={"prompt": TEXT})).json()["tokens"]
    assert (await client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1})).status_code == 200
    assert backend.requests[0].prompt_token_ids == tokens


async def test_chat_tokenize_equals_the_chat_templates_ids_and_what_chat_sends(client, backend, tokenizer):
    r = await client.post("/tokenize", json={"model": MODEL, "messages": CHAT})
    assert r.status_code == 200, r.text
    ids = tokenizer.apply_chat_template(CHAT)
    assert r.json() == {"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids}
    assert (await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})).status_code == 200
    assert backend.requests[0].prompt_token_ids == ids
    text = tokenizer.hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert (await client.post("/detokenize", json={"tokens": ids})).json() == {"prompt": text}


async def test_chat_without_the_generation_prompt_is_a_prefix(client, tokenizer):
    full = (await client.post("/tokenize", json={"messages": CHAT})).json()["tokens"]
    r = await client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    bare = r.json()["tokens"]
    assert len(bare) < len(full) and full[:len(bare)] == bare
    text = tokenizer.hf.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert bare == tokenizer.encode(text, add_special_tokens=False)


async def test_token_strs_on_request_and_empty_inputs(client, tokenizer):
    r = await client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True,
                                             "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert (await client.post("/tokenize", json={"prompt": ""})).json()["count"] == 0
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}


async def test_special_tokens_survive_detokenize(client, tokenizer):
    eos = tokenizer.hf.eos_token_id
    r = await client.post("/detokenize", json={"tokens": [*tokenizer.encode("Hi"), eos]})
    assert r.json() == {"prompt": "Hi" + tokenizer.hf.eos_token}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "gpt-4", "prompt": "Hi"}, 404, "model"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ["Hi"]}, 400, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "Hi", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": "Hi"}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "prompt": "Hi"}, 400, "prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "Hi", "model": 7}, 400, "model"),
    ("/detokenize", {"tokens": "1 2 3"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens[0]"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "Hi"}, 400, "prompt"),
])
async def test_bad_requests_are_openai_errors_naming_the_field(client, path, body, status, param):
    err = assert_openai_error(await client.post(path, json=body), status, param)
    if status == 404:
        assert err["code"] == "model_not_found" and "/v1/models" in err["message"]


@pytest.mark.parametrize("bad", [-1, "vocab", 2**63, -(2**70)])
async def test_token_ids_outside_the_vocabulary_are_refused(client, tokenizer, bad):
    bad = tokenizer.vocab_size if bad == "vocab" else bad
    err = assert_openai_error(await client.post("/detokenize", json={"tokens": [5, bad]}), 400, "tokens")
    assert err["code"] == "invalid_value" and "tokens[1]" in err["message"]
    assert str(tokenizer.vocab_size) in err["message"]


@pytest.mark.parametrize("body", [b"", b"not json", b"[1, 2]", b'{"prompt": "unterminated'])
async def test_bodies_that_are_not_json_objects(client, body):
    r = await client.post("/tokenize", content=body, headers={"content-type": "application/json"})
    assert assert_openai_error(r, 400)["code"] == "invalid_json"


async def test_the_size_limit_comes_first(client):
    r = await client.post("/tokenize", json={"model": "no-such-model", "prompt": "x" * MAX_BODY_BYTES})
    assert r.status_code == 413, r.text
    r = await client.post("/detokenize", json={"tokens": [1] * (MAX_BODY_BYTES // 2)})
    assert r.status_code == 413, r.text


async def test_a_prompt_no_context_could_hold_is_refused_by_its_length(backend, tokenizer):
    chars = backend.max_model_len * longest_token_chars(tokenizer) + 1
    app = make_app(backend, tokenizer, max_body_bytes=4 * chars)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        err = assert_openai_error(await c.post("/tokenize", json={"prompt": "a" * chars}), 400, "prompt")
        assert err["code"] == "context_length_exceeded" and str(chars) in err["message"]
        chat = [{"role": "user", "content": "a" * chars}]
        err = assert_openai_error(await c.post("/tokenize", json={"messages": chat}), 400, "messages")
        assert err["code"] == "context_length_exceeded"
        # Under the bound but over the context: counted, not refused (the count is the answer).
        r = await c.post("/tokenize", json={"prompt": "a, " * backend.max_model_len})
        assert r.status_code == 200 and r.json()["count"] > backend.max_model_len


class _ThreadRecordingTokenizer(Tokenizer):
    def __init__(self, inner: Tokenizer):
        super().__init__(inner.hf, inner.eos_token_ids)
        self.threads: list[threading.Thread] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread())
        return super().encode(text, add_special_tokens)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        self.threads.append(threading.current_thread())
        return super().decode(token_ids, skip_special_tokens)


async def test_large_inputs_are_worked_on_off_the_event_loop(tokenizer):
    recording = _ThreadRecordingTokenizer(tokenizer)
    app = make_app(FakeBackend(max_model_len=8192), recording)
    loop_thread = threading.current_thread()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        assert (await c.post("/tokenize", json={"prompt": "Hi"})).status_code == 200
        assert recording.threads.pop() is loop_thread          # small: not worth a thread hop
        r = await c.post("/tokenize", json={"prompt": "word " * (OFF_LOOP_PROMPT_SIZE // 4)})
        assert r.status_code == 200
        assert recording.threads.pop() is not loop_thread
        r = await c.post("/detokenize", json={"tokens": r.json()["tokens"] * 5})
        assert r.status_code == 200
        assert recording.threads.pop() is not loop_thread


async def test_retrieve_a_model_card(client, backend):
    r = await client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200, r.text
    card = r.json()
    assert card == (await client.get("/v1/models")).json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == backend.max_model_len
    err = assert_openai_error(await client.get("/v1/models/gpt-4"), 404, "model")
    assert err["code"] == "model_not_found" and MODEL in err["message"]


async def test_a_served_name_with_a_slash(backend, tokenizer):
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    app = make_app(backend, tokenizer, served_model_names=(name,))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        r = await c.get(f"/v1/models/{name}")
        assert r.status_code == 200 and r.json()["id"] == name
        assert (await c.post("/tokenize", json={"model": name, "prompt": "Hi"})).status_code == 200


KEY = "sk-test-utility-0123456789abcdef"


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/metrics", None),
    ("GET", f"/v1/models/{MODEL}", None),
])
async def test_utility_routes_need_the_key_when_keys_are_set(backend, tokenizer, method, path, body):
    app = make_app(backend, tokenizer, api_key_digests=(api_key_digest(KEY),))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        r = await c.request(method, path, json=body)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = await c.request(method, path, json=body, headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
