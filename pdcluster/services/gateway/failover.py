"""Mid-stream failover: whether a stream that lost its replica resumes, and where.

The rule (pure functions of what the gateway knows; I/O happens in
cluster_backend.py):

    lost = ReplicaLost(reason)          raised by the attempt that was streaming
    resume  <=>  failovers so far < max_failovers
                 and tokens are left to generate
                 and (reason != inter_token_deadline  or  another live replica can take it)
    where:      colocated mode                          -> colocated pool, generate
                a live decode replica other than the lost ones (or unknown)
                                                        -> decode pool, generate_colocated
                none, and fallback_to_colocated and a live prefill replica
                                                        -> prefill pool, generate_colocated
                none otherwise                          -> decode pool, generate_colocated: the
                                                           router waits for the respawned replica,
                                                           within the inter-token deadline
    how:        on the decode pool, prompt + tokens sent > resume_local_max_tokens,
                a live prefill replica (or unknown), a live decode replica to take the
                hand-off (or unknown), and the loss was not the hand-off's own
                                                        -> through the prefill pool: it prefills
                                                           prompt + tokens sent and hands the KV
                                                           off to a decode replica (generate),
                                                           as for a fresh long prompt
                otherwise                               -> recompute on the new replica itself

A stalled replica (the inter-token deadline) is alive and no respawn is
coming, so with no other replica the stream ends with the deadline's error
as before; a dead one is being replaced, so waiting for it is worth the
deadline.  A resumed attempt recomputes prompt + tokens already sent on the
new replica (its prefix cache and the global index keep that short when the
prompt is shared) and streams on from the next token (resume.py).  A long
remainder would stall every stream on that decode replica for several
prefill chunks -- the interference disaggregation exists to remove -- so it
goes through the prefill pool instead, unless the pool has no live replica,
no decode replica but a respawning one could take the hand-off (its lease
would run down while the router waits), or the lost hand-off was the
prefill pool's (a failed pull, an expired lease: the replica that made it
may be the one gone; recomputing needs nothing from it).  The remainder is
counted without prefix-cache hits: the gateway does not know them, and the
replica that prefills finds them either way.

What is not a lost replica -- a full pool (429), a request the engine
refused or failed alone (bad parameters, non-finite logits), the end-to-end
deadline, a client that left -- never fails over: another replica would
answer the same."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdcluster.services.backend import BackendError, BackendFailure, BackendKVTransferFailed, BackendLeaseExpired, BackendUnavailable


class FailoverReason(str, enum.Enum):
    REPLICA_DIED = "replica_died"              # the replica's actor is gone (SIGKILL, OOM, node loss)
    ENGINE_DIED = "engine_died"                # its engine loop died; Serve is replacing it
    STREAM_BROKEN = "stream_broken"            # the stream failed with no typed cause
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # the pull from the prefill replica broke (it died)
    KV_LEASE_EXPIRED = "kv_lease_expired"      # the hand-off's lease ran out before the pull
    INTER_TOKEN_DEADLINE = "inter_token_deadline"  # the replica went silent (stalled)


# Losses that mean the replica itself is gone or stuck: the resumed attempt avoids it.  A
# broken stream or a failed pull says nothing against the decode replica that reported it.
AVOIDED = frozenset({FailoverReason.REPLICA_DIED, FailoverReason.ENGINE_DIED, FailoverReason.INTER_TOKEN_DEADLINE})


def lost_reason(err: BaseException) -> FailoverReason | None:
    """Why a typed error a replica's stream raised means its replica (or the
    hand-off it pulled) was lost; None for a request-level error."""
    if isinstance(err, BackendKVTransferFailed):
        return FailoverReason.KV_TRANSFER_FAILED
    if isinstance(err, BackendLeaseExpired):
        return FailoverReason.KV_LEASE_EXPIRED
    if isinstance(err, BackendUnavailable):  # a replica says so only when its engine loop died
        return FailoverReason.ENGINE_DIED
    return None


class ReplicaLost(BackendFailure):
    """The replica serving a stream was lost; ``cause`` is the typed error
    the client gets if the stream cannot fail over (its HTTP meaning kept)."""

    def __init__(self, reason: FailoverReason, message: str, replica: str = "", cause: BaseException | None = None):
        super().__init__(message)
        self.reason, self.replica, self.cause = reason, replica, cause

    def final_error(self) -> BaseException:
        return self.cause if self.cause is not None else self


def decode_call_over(exc: BaseException) -> bool:
    """Whether a decode call that raised ``exc`` has ended on its replica, so
    no pull of its hand-off can still be reading the prefill replica's blocks.
    A typed error is the replica's own answer (its ``generate`` ran its
    ``finally``: the pull had ended and the lease was released there); a dead
    replica reads nothing.  A cancellation (the client left, a deadline) or a
    broken stream says nothing of the replica: its pull may still run, and it
    releases the lease itself once that pull ended."""
    if isinstance(exc, ReplicaLost):
        return exc.reason is FailoverReason.REPLICA_DIED or exc.cause is not None
    return isinstance(exc, BackendError)


@dataclass(frozen=True)
class FailoverDecision:
    resume: bool
    why: str        # when not resuming: the sentence the error event carries


# Losses of the hand-off itself: the resumed attempt does not hand off again.
HANDOFF_LOST = frozenset({FailoverReason.KV_TRANSFER_FAILED, FailoverReason.KV_LEASE_EXPIRED})
RECOMPUTE, PREFILL_POOL = "recompute", "prefill_pool"


@dataclass(frozen=True)
class ResumeTarget:
    pool: str       # the Serve pool that streams the resumed attempt
    method: str     # its method: both phases (generate_colocated / generate), or decode after a hand-off
    via_prefill_pool: bool = False  # prefilled by the prefill pool, KV handed off to ``pool``

    @property
    def path(self) -> str:
        """What the ``decode.failover`` span and the log line call it."""
        return PREFILL_POOL if self.via_prefill_pool else RECOMPUTE


def decide(reason: FailoverReason, num_failovers: int, max_failovers: int, tokens_left: int,
           live_elsewhere: int | None) -> FailoverDecision:
    """Whether a stream that lost its replica for ``reason`` resumes.
    ``live_elsewhere``: live replicas that could take it, not counting the
    lost ones (None: unknown)."""
    if tokens_left <= 0:
        return FailoverDecision(False, "the stream had nothing left to generate")
    if num_failovers >= max_failovers:
        return FailoverDecision(False, f"the stream lost its replica {num_failovers + 1} times and max_failovers "
                                       f"is {max_failovers}: retry the request, or raise max_failovers")
    if reason is FailoverReason.INTER_TOKEN_DEADLINE and not live_elsewhere:
        return FailoverDecision(False, "the stalled replica is the only one that could continue the stream")
    return FailoverDecision(True, "")


def resume_target(mode: str, decode_elsewhere: int | None, prefill_live: int | None,
                  fallback_to_colocated: bool) -> ResumeTarget:
    """Where a resumed stream goes (see the rule at the top)."""
    if mode == "colocated":
        return ResumeTarget("colocated", "generate")
    if decode_elsewhere is None or decode_elsewhere > 0:
        return ResumeTarget("decode", "generate_colocated")
    if fallback_to_colocated and prefill_live:
        return ResumeTarget("prefill", "generate_colocated")
    return ResumeTarget("decode", "generate_colocated")


def resume_path(target: ResumeTarget, num_tokens: int, local_max_tokens: int, prefill_live: int | None,
                decode_elsewhere: int | None, reason: FailoverReason) -> ResumeTarget:
    """``target``, through the prefill pool when the ``num_tokens`` to
    prefill again (prompt + tokens sent) are too many to recompute on the new
    decode replica (see the rule at the top).  ``prefill_live``,
    ``decode_elsewhere``: live replicas (None: unknown), as for resume_target."""
    if (target.pool != "decode" or num_tokens <= local_max_tokens or prefill_live == 0 or decode_elsewhere == 0
            or reason in HANDOFF_LOST):
        return target
    return ResumeTarget("decode", "generate", via_prefill_pool=True)


def live_elsewhere(live: int | None, lost_here: int) -> int | None:
    """Live replicas of a pool not counting the ones this stream lost (a
    killed replica stays on the status board until its key expires)."""
    return None if live is None else max(live - lost_here, 0)


def gave_up_message(lost: ReplicaLost, why: str, history: tuple[str, ...]) -> str:
    """The error event's sentence: the cause, what happened before, what to
    do.  ``history``: StreamProgress.lost (``reason@replica``); the client is
    told the reasons only -- the replicas and the loss's own text are in the
    gateway's log (FailoverLog.gave_up_on) and the trace."""
    reasons = [entry.split("@", 1)[0] for entry in history]
    before = f" (earlier: {', '.join(reasons)})" if reasons else ""
    return f"{lost.reason.value}: {why}{before}"
