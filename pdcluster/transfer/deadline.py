"""One deadline per pull, checked by every wait inside it."""

from __future__ import annotations

import time

from pdcluster.transfer.errors import TransferError


class Deadline:
    def __init__(self, timeout_s: float, what: str) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.what = what
        self.started_at = time.monotonic()

    def remaining_s(self) -> float:
        return self.timeout_s - (time.monotonic() - self.started_at)

    def expired(self) -> bool:
        return self.remaining_s() <= 0

    def check(self) -> None:
        if self.expired():
            raise self.timeout_error()

    def socket_timeout_s(self) -> float:
        """Remaining time for a blocking socket call; raises once it is gone."""
        remaining = self.remaining_s()
        if remaining <= 0:
            raise self.timeout_error()
        return remaining

    def timeout_error(self) -> TransferError:
        return TransferError(
            f"{self.what} timed out after {self.timeout_s:g} s; the peer is stalled or unreachable. "
            "Free the local blocks and retry elsewhere, or raise the transfer timeout if the peer is only slow.")
