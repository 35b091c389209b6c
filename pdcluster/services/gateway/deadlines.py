"""The deadlines a request's stream runs under, as one decision: which of
them ends the next wait for a chunk (relay.py waits under one timer set to it).

    request      arrival + request_timeout_s, for the whole stream: 504, or an SSE error event
    first token  until the first chunk goes to the client: arrival + first_token_s (at most
                 the request's end): a request whose first token is far later than admission
                 predicted is aborted everywhere, not left waiting for the end-to-end deadline
    inter-token  per attempt, from the start of each wait: armed after the attempt's first
                 chunk, or at once for a resumed attempt (the client is already waiting);
                 passing it is a lost replica (ReplicaLost), so the stream may fail over

Expiry cancels the wait, which cancels the replica calls in flight (their
``finally`` blocks abort and release).  On a tie the request's own end wins."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from pdcluster.observability import metrics
from pdcluster.services.backend import BackendTimeout, for_client
from pdcluster.services.gateway.failover import FailoverReason, ReplicaLost


class Deadline(Enum):
    REQUEST = "request"
    FIRST_TOKEN = "first_token"
    INTER_TOKEN = "inter_token"


@dataclass(frozen=True)
class Deadlines:
    """Absolute times on the event loop's clock, and the settings they came from (for the messages)."""
    request_end_s: float
    first_token_end_s: float   # at most request_end_s
    inter_token_s: float       # a gap, per wait
    request_timeout_s: float
    first_token_timeout_s: float

    @classmethod
    def starting(cls, now_s: float, request_timeout_s: float, inter_token_timeout_s: float,
                 first_token_timeout_s: float = math.inf) -> Deadlines:
        end_s = now_s + request_timeout_s
        return cls(end_s, min(end_s, now_s + first_token_timeout_s), inter_token_timeout_s, request_timeout_s,
                   first_token_timeout_s)

    def next_wait(self, now_s: float, first_sent: bool, gap_armed: bool) -> tuple[float, Deadline]:
        """When the wait that starts now ends, and which deadline that is."""
        wait = (self.request_end_s, Deadline.REQUEST)
        if not first_sent and self.first_token_end_s < wait[0]:
            wait = (self.first_token_end_s, Deadline.FIRST_TOKEN)
        if gap_armed and now_s + self.inter_token_s < wait[0]:
            wait = (now_s + self.inter_token_s, Deadline.INTER_TOKEN)
        return wait

    def expired(self, which: Deadline, replica: str) -> Exception:
        """The error a passed deadline raises (counted): BackendTimeout for the request's own
        deadlines; ReplicaLost(INTER_TOKEN_DEADLINE) for a silent attempt, which may fail over."""
        metrics.count_deadline(which.value)
        if which is Deadline.FIRST_TOKEN:
            return for_client(BackendTimeout(
                f"no first token within {self.first_token_timeout_s:.0f} s (admission.first_token_timeout_s, "
                "or 3x the predicted time to first token when longer); the request was aborted: retry it"))
        if which is Deadline.REQUEST:
            return for_client(BackendTimeout(f"the request ran past its {self.request_timeout_s:g} s deadline "
                                             "(admission.request_timeout_s) and was aborted"))
        timeout = for_client(BackendTimeout(f"no token for {self.inter_token_s:g} s "
                                            "(admission.inter_token_timeout_s); the request was aborted: retry it"))
        return ReplicaLost(FailoverReason.INTER_TOKEN_DEADLINE, str(timeout), replica, cause=timeout)
