"""Stand-ins for Serve's handles in the cluster backend's unit tests
(test_cluster_backend_failures.py, test_failover.py): the prefill/decode
server classes by pool, one prefill hand-off, an awaitable response and a
streaming response that can fail or stall."""

from __future__ import annotations

import asyncio
import concurrent.futures

from pdcluster.services.pools.decode import DecodeServer
from pdcluster.services.messages import PrefillResponse
from pdcluster.services.pools.prefill import PrefillServer

SERVERS = {"prefill": PrefillServer, "decode": DecodeServer}

HANDOFF = PrefillResponse(request_id="r1", first_token_id=5, text="a", finish_reason=None, block_ids=(3, 4),
                          num_tokens=20, num_cached_tokens=0, peer=b"peer", worker_name="prefill-x", prefill_s=0.1,
                          lease_deadline_unix=1e12)


class FakeResponse:
    """A DeploymentResponse: awaitable (its value, or it raises ``error``), cancellable."""

    def __init__(self, value, error: BaseException | None = None):
        self.value, self.error, self.cancelled = value, error, False

    def __await__(self):
        async def get():
            if self.error is not None:
                raise self.error
            return self.value
        return get().__await__()

    def cancel(self):
        self.cancelled = True
        if hasattr(self, "_replica_result_future"):
            self._replica_result_future.cancel()  # as Serve's: a no-op once assigned


class FakeStream:
    def __init__(self, deltas=(), error=None, stall_after=None, assigned=None):
        """``assigned``: True/False gives the stream Serve's assignment future (done, or
        pending until cancelled); None leaves it out, as a handle that cannot tell."""
        self.deltas, self.error, self.stall_after, self.cancelled = list(deltas), error, stall_after, False
        if assigned is not None:
            self._replica_result_future = concurrent.futures.Future()
            if assigned:
                self._replica_result_future.set_result(None)

    def __aiter__(self):
        async def gen():
            for i, d in enumerate(self.deltas):
                if i == self.stall_after:
                    while not self.cancelled:  # stalled until cancelled, then ended as Serve's call is
                        await asyncio.sleep(0.01)
                    raise RuntimeError("the call was cancelled")
                yield d
            if self.error is not None:
                raise self.error
        return gen()

    def cancel(self):
        self.cancelled = True
        if hasattr(self, "_replica_result_future"):
            self._replica_result_future.cancel()  # as Serve's: a no-op once assigned
