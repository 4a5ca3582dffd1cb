"""The workload's roofline floor: the work it cannot avoid, and the machine's rate for that work, both measured here.

Work (`workload_work`, pure arithmetic over the model's linear shapes and the workload's token counts):

- body FLOPs per token = ``2 * N_body`` (a multiply and an add per weight of every linear layer except the LM head;
  embeddings and norms are left out);
- attention FLOPs per token at position p = ``4 * H * D * sum_l min(p + 1, window_l)`` (QK^T and PV over the keys
  the token sees in each layer l; window = infinity for full attention);
- LM head FLOPs per sampled token = ``2 * hidden * vocab``;
- prefill: every *distinct* prompt token (a prefix shared by several prompts is computed once, the best a prefix
  cache can do), at the attention cost of its position;
- decode: ``G_r - 1`` body tokens per request (the last sampled token is never fed back) at positions
  ``P_r .. P_r + G_r - 2``, plus the LM head for all ``G_r`` sampled tokens;
- bytes: ``max_r G_r`` forwards at least (each new token of a request needs the previous one), each reading every
  linear weight once, plus every computed token's K and V written once and read at least once:
  ``max_r G_r * weight_bytes + 2 * kv_bytes_per_token * (distinct prompt tokens + decode tokens)``.

Rates (`gemm_rate`, `bandwidth`: `cbnb.measure.rates`, re-exported here; measured in the same run as the peers): the
model's own linear layers (its real weights, fp32 on CPU) applied to random activations of ``rows`` tokens, in
module order, timed as a whole; prefill
at ``rows = min(max_batch_tokens, prompt tokens)`` (body only: the LM head sees only sampled rows), decode at
``rows = min(requests, max_requests_per_batch, max_batch_tokens)`` (body + LM head). Bandwidth: a copy of a buffer
larger than the last-level cache, counted as bytes read + bytes written.

Floor (`floor`): ``compute_s = prefill FLOPs / prefill rate + decode FLOPs / decode rate``,
``bytes_s = bytes / bandwidth``, ``floor_s = max(compute_s, bytes_s)``. A peer's share of the roofline is
``floor_s / its seconds`` (1.0 = at the floor). Each rate is the fastest of a few passes, and the bench computes the
floor from the best rates of the whole run (what this machine showed it can do): on a shared machine a probe that
lands in a busy moment would otherwise lower the floor and inflate every share.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..measure.rates import bandwidth, gemm_rate, probe, square_gemm_rate

__all__ = ["ModelCost", "Work", "FORMULAS", "model_cost", "distinct_prefix_positions", "workload_work", "floor",
           "gemm_rate", "square_gemm_rate", "bandwidth", "probe", "work_dict"]

FORMULAS = {
    "body_flops_per_token": "2 * N_body (N_body = in*out summed over every linear layer but the LM head)",
    "attention_flops_per_token": "4 * H * D * sum_l min(p + 1, window_l) at position p",
    "lm_head_flops_per_sampled_token": "2 * hidden * vocab",
    "flops_prefill": "2 * N_body * distinct prompt tokens + attention over their positions",
    "flops_decode": "2 * N_body * sum_r (G_r - 1) + attention over the decode positions + 2 * hidden * vocab * sum_r G_r",
    "bytes": "max_r G_r * weight_bytes + 2 * kv_bytes_per_token * (distinct prompt tokens + sum_r (G_r - 1))",
    "compute_s": "flops_prefill / gemm_rate(prefill rows) + flops_decode / gemm_rate(decode rows)",
    "bytes_s": "bytes / copy bandwidth",
    "floor_s": "max(compute_s, bytes_s) at the run's best probe rates; share of a peer = floor_s / peer seconds",
}


@dataclass(frozen=True)
class ModelCost:
    """What the roofline needs from a model (plain numbers; build it with `model_cost`).

    Attributes:
        body: ``(in_features, out_features)`` of every linear layer except the LM head (all layers).
        head: ``(hidden, vocab)`` of the LM head.
        num_heads, head_dim: query heads and head dimension (attention FLOPs).
        windows: per layer, the sliding window in tokens or None (full attention).
        kv_bytes_per_token: K and V of one token over all layers (bytes).
        weight_bytes: every linear weight, LM head included (bytes).
    """

    body: tuple[tuple[int, int], ...]
    head: tuple[int, int]
    num_heads: int
    head_dim: int
    windows: tuple[int | None, ...]
    kv_bytes_per_token: int
    weight_bytes: int

    @property
    def body_params(self) -> int:
        return sum(i * o for i, o in self.body)

    def attention_flops(self, position: int) -> float:
        """FLOPs of one token's attention at 0-based `position` (QK^T and PV in every layer)."""
        keys = sum(position + 1 if w is None else min(position + 1, w) for w in self.windows)
        return 4.0 * self.num_heads * self.head_dim * keys


@dataclass(frozen=True)
class Work:
    """The unavoidable work of a workload on a model (FLOPs and bytes; see the module docstring)."""

    prompt_tokens: int
    distinct_prompt_tokens: int
    output_tokens: int
    decode_tokens: int
    min_forwards: int
    flops_prefill: float
    flops_decode: float
    bytes: float

    @property
    def flops(self) -> float:
        return self.flops_prefill + self.flops_decode


def model_cost(model: Any) -> ModelCost:
    """`ModelCost` of a transformers causal LM, from its `nn.Linear` modules and its config."""
    import torch

    from ..core.cache.layout import layer_groups, model_kv_spec

    head_mod = model.get_output_embeddings()
    body = tuple((m.in_features, m.out_features) for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and m is not head_mod)
    spec = model_kv_spec(model.config)
    windows: list[int | None] = [None] * spec["num_layers"]
    for g in layer_groups(spec["num_layers"], spec["layer_types"], spec["sliding_window"]):
        for layer in g.layers:
            windows[layer] = g.window
    itemsize = next(model.parameters()).element_size()
    head = (spec["hidden_size"], spec["vocab_size"])
    return ModelCost(
        body=body, head=head, num_heads=spec["num_heads"], head_dim=spec["head_dim"], windows=tuple(windows),
        kv_bytes_per_token=2 * spec["num_layers"] * spec["num_kv_heads"] * spec["head_dim"] * itemsize,
        weight_bytes=(sum(i * o for i, o in body) + head[0] * head[1]) * itemsize,
    )


def distinct_prefix_positions(prompts: Sequence[Sequence[int]]) -> dict[int, int]:
    """How many distinct prompt prefixes end at each 0-based position: ``{position: count}``.

    A token is computed once per distinct prefix that ends with it (a trie over the prompts), so the sum of the
    counts is the number of prompt tokens a perfect prefix cache computes.
    """
    root: dict = {}
    counts: dict[int, int] = {}
    for p in prompts:
        node = root
        for pos, tok in enumerate(p):
            nxt = node.get(tok)
            if nxt is None:
                nxt = node[tok] = {}
                counts[pos] = counts.get(pos, 0) + 1
            node = nxt
    return counts


def workload_work(cost: ModelCost, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> Work:
    """FLOPs and bytes the workload cannot avoid on this model (formulas in `FORMULAS`).

    Raises:
        ValueError: prompts and max_new_tokens differ in length, or a request generates no token.
    """
    if len(prompts) != len(max_new_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
    if any(g < 1 for g in max_new_tokens):
        raise ValueError("every request must generate at least one token")
    body_tok = 2.0 * cost.body_params
    positions = distinct_prefix_positions(prompts)
    distinct = sum(positions.values())
    flops_prefill = body_tok * distinct + sum(n * cost.attention_flops(p) for p, n in positions.items())
    decode_tokens = sum(g - 1 for g in max_new_tokens)
    attn_decode = sum(cost.attention_flops(len(p) + j) for p, g in zip(prompts, max_new_tokens) for j in range(g - 1))
    head = 2.0 * cost.head[0] * cost.head[1]
    flops_decode = body_tok * decode_tokens + attn_decode + head * sum(max_new_tokens)
    min_forwards = max(max_new_tokens, default=0)
    nbytes = min_forwards * cost.weight_bytes + 2 * cost.kv_bytes_per_token * (distinct + decode_tokens)
    return Work(sum(len(p) for p in prompts), distinct, sum(max_new_tokens), decode_tokens, min_forwards,
                flops_prefill, flops_decode, float(nbytes))


def floor(work: Work, prefill_flops_per_s: float, decode_flops_per_s: float, bytes_per_s: float) -> dict[str, float]:
    """The roofline floor of `work` at the given rates: compute_s, bytes_s, floor_s and floor_tok_per_s.

    Raises:
        ValueError: a rate that is not positive.
    """
    for name, v in (("prefill_flops_per_s", prefill_flops_per_s), ("decode_flops_per_s", decode_flops_per_s),
                    ("bytes_per_s", bytes_per_s)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0; got {v}")
    compute_s = work.flops_prefill / prefill_flops_per_s + work.flops_decode / decode_flops_per_s
    bytes_s = work.bytes / bytes_per_s
    floor_s = max(compute_s, bytes_s)
    return {"compute_s": compute_s, "bytes_s": bytes_s, "floor_s": floor_s,
            "floor_tok_per_s": work.output_tokens / floor_s if floor_s > 0 else 0.0}


def work_dict(work: Work) -> dict[str, Any]:
    d = asdict(work)
    d["flops"] = work.flops
    return d
