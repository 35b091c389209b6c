"""Every input counts toward the size bounds, on a real cluster (issue 33,
acceptance 3): a chat with a one-word message and about 1 MiB of tool
definitions is refused (413 over the body limit, 400 under it) before any
template is rendered, and another stream's inter-token gap stays under
0.5 s while the gateway processes it.

Before the tools counted, the body under the limit was parsed, its ~1 MB
system prompt rendered and tokenized on the gateway's event loop (about a
second on a 2-core machine), then refused for its token count; the stream
relayed by that loop stalled as long."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.integration.faults.conftest import MODEL, wait_no_leaks

pytestmark = pytest.mark.integration
MAX_GAP_S = 0.5


def tools_body(target_bytes: int) -> bytes:
    """A chat body of about ``target_bytes``: "hi" and tool definitions with long, varied descriptions."""
    words = " ".join(f"w{j}x{j % 97}" for j in range(1200))      # ~10 KB of text that tokenizes like prose
    tools, size = [], 200
    while size < target_bytes - len(words) - 200:
        tools.append({"type": "function", "function": {"name": f"tool_{len(tools)}", "description": words,
                                                       "parameters": {"type": "object", "properties": {}}}})
        size += len(words) + 120
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                       "tool_choice": "auto", "max_tokens": 4}).encode()
    assert body.count(b'"type": "function"') <= 128        # within MAX_TOOLS: the size is what must refuse it
    return body


class StreamTimes:
    """A streamed completion read in a thread; the arrival time of each SSE event."""

    def __init__(self, url: str):
        self.url, self.times, self.done, self.error = url, [], threading.Event(), None
        self.error_events: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        body = {"model": MODEL, "prompt": "Count from one to one thousand:", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", self.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.times.append(time.monotonic())
                        if '"error"' in line:
                            self.error_events.append(line)
                    if self.stop.is_set():
                        break
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.done.set()

    def gaps_between(self, start_s: float, end_s: float) -> list[float]:
        times = self.times
        return [b - a for a, b in zip(times, times[1:]) if b >= start_s and a <= end_s]


def test_a_request_with_a_mib_of_tools_is_refused_before_rendering_and_does_not_stall_a_stream(url, faults_cluster):
    limit = faults_cluster.config.max_body_bytes
    over, under = tools_body(limit + 64 * 1024), tools_body(limit - 8 * 1024)
    assert len(over) > limit >= len(under) > limit - 16 * 1024
    stream = StreamTimes(url)
    deadline = time.monotonic() + 20
    while len(stream.times) < 5:                  # streaming steadily before the big requests arrive
        assert not stream.done.is_set() and time.monotonic() < deadline, stream.error
        time.sleep(0.01)
    start_s = time.monotonic()
    headers = {"content-type": "application/json"}
    answers = [httpx.post(url + "/v1/chat/completions", content=body, headers=headers, timeout=60)
               for body in (over, under)]
    end_s = time.monotonic()
    time.sleep(MAX_GAP_S)                         # a stall that began inside the window ends inside this
    stream.stop.set()
    stream.done.wait(30)
    assert stream.error is None and not stream.error_events, (stream.error, stream.error_events)
    gaps = stream.gaps_between(start_s, end_s + MAX_GAP_S)
    assert gaps and max(gaps) < MAX_GAP_S, (f"max gap {max(gaps):.2f} s", f"requests took {end_s - start_s:.2f} s")
    assert stream.times[-1] > end_s + MAX_GAP_S / 2, "the stream ended before the window did: raise max_tokens"

    assert answers[0].status_code == 413, answers[0].text
    assert answers[0].json()["error"]["code"] == "request_too_large"
    err = answers[1].json()["error"]
    assert answers[1].status_code == 400 and err["param"] == "tools", answers[1].text
    assert err["code"] == "context_length_exceeded" and "tools" in err["message"]   # by size, not a token count
    wait_no_leaks(faults_cluster)
