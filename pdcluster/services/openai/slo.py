"""The latency targets goodput is counted against at the gateway: a finished
request is ``met`` when its client-seen TTFT is at most ``ttft_s`` and its
TPOT (mean gap after the first token) at most ``tpot_s``; a request with one
token has no TPOT and is judged on TTFT alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be positive seconds (ttft_s={self.ttft_s}, tpot_s={self.tpot_s}): "
                             f"set admission.ttft_slo_s and admission.tpot_slo_s above 0")

    def outcome(self, ttft_s: float | None, tpot_s: float | None) -> str:
        """``met`` | ``missed``; no first token at all is a miss."""
        if ttft_s is None or ttft_s > self.ttft_s:
            return "missed"
        return "missed" if tpot_s is not None and tpot_s > self.tpot_s else "met"
