"""Next-token choice per request: greedy, or temperature / top-k / top-p
sampling with a per-request seeded generator."""

from __future__ import annotations

import torch

from services.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator()
            if params.seed is not None:
                g.manual_seed(params.seed)
            else:
                g.seed()
            self._generators[request_id] = g
        return g

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """``logits``: fp32 [N, vocab], one row per request."""
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        greedy_ids = logits.argmax(dim=-1).tolist()
        out = []
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if p.greedy:
                out.append(greedy_ids[row])
                continue
            probs = probabilities(logits[row], p)
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(rid, p)).item()))
        return out


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted to top-k, then to the
    smallest set whose mass reaches top-p (always keeping the best token)."""
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        keep = torch.topk(x, p.top_k).indices  # exactly k, even when logits tie
        x = torch.full_like(x, float("-inf")).scatter(0, keep, x[keep])
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= p.top_p  # mass before this token already enough
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    return torch.softmax(x, dim=-1)
