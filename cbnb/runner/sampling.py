"""Token sampling for the rows of a step: greedy, temperature, top-k, top-p, per-request seeds.

Order as in transformers' warpers: temperature, then top-k, then top-p (keep the smallest set of most likely tokens
whose mass reaches `top_p`, at least one), then a multinomial draw. A request with a `seed` gets its own
`torch.Generator`, so its samples do not depend on what else shares the batch; requests without one draw from the
engine's generator (seeded by `ContinuousBatchingConfig.seed` when set).
"""

from __future__ import annotations

import torch

from ..requests import SamplingParams

__all__ = ["Sampler"]


class Sampler:
    """Samples one token per logits row.

    Args:
        device: where logits live.
        seed: seed of the engine-wide generator (None: nondeterministic).
    """

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def adopt(self, other: "Sampler") -> None:
        """Continue the per-request generators of `other` (an engine rebuilt by `reconfigure`), so a seeded request
        that survives a rebuild draws the same samples as an uninterrupted run. Generators on another device are
        dropped (their requests restart from their seed)."""
        for rid, g in other._per_request.items():
            if g.device == self.generator.device:
                self._per_request[rid] = g

    def _gen(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        g = self._per_request.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(params.seed)
            self._per_request[request_id] = g
        return g

    @staticmethod
    def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Apply temperature, top-k and top-p to one row ``[V]`` (fp32); filtered entries become -inf."""
        x = logits / params.temperature if params.temperature != 1.0 else logits.clone()
        if params.top_k is not None and params.top_k < x.shape[-1]:
            kth = torch.topk(x, params.top_k).values[-1]
            x[x < kth] = float("-inf")
        if params.top_p is not None and params.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=False)
            cum = sorted_x.softmax(-1).cumsum(-1)
            drop = cum <= (1 - params.top_p)
            drop[-1] = False  # always keep the most likely token
            x[order[drop]] = float("-inf")
        return x

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """One token per row of ``logits [S, V]`` (any float dtype; processed in fp32)."""
        if logits.shape[0] == 0:
            return []
        logits = logits.float()
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if not p.do_sample]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            out[idx] = logits.index_select(0, idx).argmax(-1)
        for i, p in enumerate(params):
            if p.do_sample:
                probs = self.process(logits[i], p).softmax(-1)
                out[i] = torch.multinomial(probs, 1, generator=self._gen(request_ids[i], p))[0]
        return out.tolist()
