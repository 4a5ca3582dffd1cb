"""Fleets in the simulator: tensor parallelism and replicas behind a router (torch-free).

A simulation of how existing engines (vLLM, SGLang) serve a model on several GPUs; nothing distributed is built.

**Tensor parallelism** (Megatron-style, as vLLM's `--tensor-parallel-size`): a TP group of `tp` GPUs is simulated as
one device with `tp` times the memory (weights and KV cache split across the GPUs), FLOP/s and memory bandwidth (each
GPU computes its share of every matmul and attention head at the same time), plus two all-reduces per decoder layer
(after the attention output projection and after the MLP down projection), each over the step's activations
(`tokens x hidden_size x itemsize` bytes). One all-reduce costs, for a ring over `tp` GPUs (the standard formula of
NCCL's performance notes, `busbw = algbw x 2 (n - 1) / n`):

    t = latency_s + 2 (tp - 1) / tp x bytes / bandwidth      (0 for tp = 1)

with the link's one-direction bandwidth per GPU and a fixed latency per call (the profile's `interconnect_bandwidth`
and `interconnect_latency_s`: datasheet bandwidths in the bundled GPU profiles, the latencies assumed). The all-reduce time is added to the step's compute through the profile's
`cost_factors["compute"]` curve (a factor by step tokens), so the cost model prices it without a change of its own;
`allreduce_step_s` gives the added seconds. Elementwise operators (norms, residuals) are replicated on every GPU and
keep one GPU's rate. Not modelled: KV heads replicated when `tp` exceeds the model's KV heads, pipeline parallelism,
expert parallelism.

**Replicas** (`Fleet`): `replicas` copies of one engine (each a `SimEngine` on the TP group's profile), behind a
router that sends each arriving request to one replica: "round_robin" (request i to replica i mod N) or
"least_loaded" (the replica with the fewest unfinished requests at the arrival instant, the lowest index on a tie;
the replicas are simulated side by side up to each arrival).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from ..core.config import ContinuousBatchingConfig
from .cost import CostModel
from .loads import StepLoad
from .engine import SimEngine
from .profiles import HardwareProfile, load_profile
from .shapes import ModelShape, load_shape

__all__ = ["Interconnect", "link_of", "ROUTERS", "allreduce_s", "allreduce_step_s", "tensor_parallel", "Fleet"]


@dataclass(frozen=True)
class Interconnect:
    """The GPU-to-GPU link of a TP group.

    Attributes:
        name: e.g. "NVLink 4".
        bandwidth: one direction, per GPU (bytes/s).
        latency_s: fixed seconds of one all-reduce call (launch and synchronisation).
        source: where the figures come from ("datasheet: ..."; the latency is assumed).
    """

    name: str
    bandwidth: float
    latency_s: float
    source: str


ROUTERS: tuple[str, ...] = ("round_robin", "least_loaded")


def link_of(profile: Any) -> Interconnect:
    """The GPU link a profile records (`interconnect_bandwidth`, `interconnect_latency_s`, their sources).

    Raises:
        ValueError: the profile has no interconnect figures (pass ``link=Interconnect(...)``, or set them).
    """
    p = load_profile(profile)
    if p.interconnect_bandwidth is None:
        raise ValueError(f"profile {p.name!r} has no interconnect_bandwidth (the GPU-to-GPU link a tensor-parallel "
                         "group's all-reduces use): set it, or pass link=Interconnect(...)")
    src = dict(p.sources)
    how = src.get("interconnect_bandwidth", "not cited")
    return Interconnect(f"{p.name} link", float(p.interconnect_bandwidth),
                        float(p.interconnect_latency_s or 0.0),
                        f"{how}; {src.get('interconnect_latency_s', 'latency not cited')}")


def allreduce_s(nbytes: float, tp: int, link: Interconnect) -> float:
    """Seconds of one ring all-reduce of `nbytes` over `tp` GPUs (see the module formula); 0 for tp = 1."""
    if tp <= 1:
        return 0.0
    return link.latency_s + 2.0 * (tp - 1) / tp * nbytes / link.bandwidth


def allreduce_step_s(shape: ModelShape, tokens: int, tp: int, link: Interconnect) -> float:
    """The all-reduce seconds of one step of `tokens` query tokens: two per decoder layer over the activations."""
    return 2 * shape.num_layers * allreduce_s(tokens * shape.hidden_size * shape.itemsize, tp, link)


def _check_tp(shape: ModelShape, tp: Any) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1; got {tp!r}")
    if shape.num_heads % tp:
        raise ValueError(f"tensor_parallel_size must divide the attention heads of {shape.name} "
                         f"({shape.num_heads}), as vLLM requires; got {tp}")
    return tp


def _scaled_curves(curves: Any, k: float) -> Any:
    if not curves:
        return curves
    return {dt: [[r, v * k] for r, v in pts] for dt, pts in curves.items()}


def tensor_parallel(profile: Any, tp: int, shape: Any, config: ContinuousBatchingConfig | None = None, *,
                    link: Interconnect | None = None) -> HardwareProfile:
    """The profile of a TP group of `tp` GPUs of `profile` serving `shape` (see the module docstring).

    Args:
        profile: a `HardwareProfile` or a name `load_profile` takes.
        tp: the tensor-parallel size (1: the profile itself).
        shape: the model (the all-reduce sizes depend on its layers, hidden size and dtype).
        config: the engine config (its token budget bounds the all-reduce curve; its CUDA graphs and page size as the
            cost model reads them).
        link: the GPU link; default the profile's (`link_of`).

    Raises:
        ValueError: `tp` is not an integer >= 1 or does not divide the model's heads; the profile records no link
            (pass `link=`).
    """
    base = load_profile(profile)
    shape = load_shape(shape)
    tp = _check_tp(shape, tp)
    if tp == 1:
        return base
    if link is None:
        link = link_of(base)
    group = dataclasses.replace(
        base, name=f"{base.name}-tp{tp}", memory_bytes=base.memory_bytes * tp, reserved_bytes=base.reserved_bytes * tp,
        peak_flops={k: v * tp for k, v in base.peak_flops.items()}, memory_bandwidth=base.memory_bandwidth * tp,
        host_device_bandwidth=base.host_device_bandwidth * tp, gemm_flops=_scaled_curves(base.gemm_flops, tp),
        attention_flops=_scaled_curves(base.attention_flops, tp),
        sources={**dict(base.sources), "tensor_parallel": f"{tp} x {base.name} ({link.name}): {link.source}"},
        notes=(base.notes + " " if base.notes else "") + f"Tensor-parallel group of {tp} (cbnb.sim.fleet).")
    cfg = (config or ContinuousBatchingConfig()).resolve(group.device_type)
    model = CostModel(shape, group, cfg)
    top = max(int(cfg.max_batch_tokens or 8192), 2)
    rows, t = [], 1
    while t < top:
        rows.append(t)
        t *= 2
    rows.append(top)
    curve = []
    for t in rows:
        compute = model.step(StepLoad.of([(0, t, True)])).groups["compute"]
        curve.append([t, model.compute_factor(t) + allreduce_step_s(shape, t, tp, link) / compute])
    factors = {**dict(group.cost_factors or {}), "compute": curve}
    return dataclasses.replace(group, cost_factors=factors)


class Fleet:
    """`replicas` engines, each on a TP group of `tensor_parallel_size` GPUs of `profile`, behind a router.

    Args:
        shape, profile, config, dtype: as `SimEngine`'s (one config for every replica).
        tensor_parallel_size: GPUs per replica.
        replicas: number of engines.
        router: "round_robin" or "least_loaded" (`ROUTERS`).
        link: the GPU link (default: the profile's, `link_of`).

    Attributes:
        engines: the replicas (`SimEngine`); profile: the TP group's profile; base_profile: one GPU's;
        gpus: tensor_parallel_size x replicas; routed: per submitted request, the replica it went to.

    Raises:
        ValueError: a bad tensor_parallel_size, replicas or router (named, with the allowed values).
        MemoryError: the weights or the cache do not fit one TP group.
    """

    def __init__(self, shape: Any, profile: Any, config: ContinuousBatchingConfig | None = None, *,
                 tensor_parallel_size: int = 1, replicas: int = 1, router: str = "round_robin",
                 link: Interconnect | None = None, dtype: Any = None) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1; got {replicas!r}")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(map(repr, ROUTERS))}; got {router!r}")
        self.shape = load_shape(shape, dtype=dtype)
        self.base_profile = load_profile(profile)
        self.tensor_parallel_size = _check_tp(self.shape, tensor_parallel_size)
        self.replicas, self.router = replicas, router
        self.profile = tensor_parallel(self.base_profile, self.tensor_parallel_size, self.shape, config, link=link)
        self.engines = [SimEngine(self.shape, self.profile, config, telemetry=False) for _ in range(replicas)]
        self.config = self.engines[0].config
        self.gpus = self.tensor_parallel_size * replicas
        self.routed: list[int] = []
        self._live: list[list[Any]] = [[] for _ in range(replicas)]

    def _route(self, arrival_s: float) -> int:
        n = len(self.routed)
        if self.router == "round_robin" or self.replicas == 1:
            return n % self.replicas
        loads = []
        for e, live in zip(self.engines, self._live):
            e.run_until(arrival_s)
            live[:] = [h for h in live if not h.done()]
            loads.append(len(live))
        return loads.index(min(loads))

    def submit(self, prompt: Sequence[int], max_new_tokens: int, *, arrival_s: float = 0.0) -> Any:
        """Route one request arriving at `arrival_s` (simulated seconds, not before an earlier one's) and submit it to
        its replica (EOS ignored). Returns the replica's handle."""
        r = self._route(arrival_s)
        h = self.engines[r].submit(list(prompt), max_new_tokens, ignore_eos=True, arrival_s=arrival_s)
        self.routed.append(r)
        self._live[r].append(h)
        return h

    def run(self) -> None:
        """Run every replica until its requests have ended."""
        for e in self.engines:
            e.run()

    def serve(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
              arrival_s: Sequence[float] | None = None) -> list[tuple[int, Any]]:
        """Submit a whole traffic (arrival times ascending; none: all at 0), run it, and return per request (replica,
        `RequestOutput`), in submission order."""
        arrivals = list(arrival_s) if arrival_s else [0.0] * len(prompts)
        handles = [self.submit(p, int(m), arrival_s=float(a)) for p, m, a in zip(prompts, max_new_tokens, arrivals)]
        self.run()
        return [(r, h.result()) for r, h in zip(self.routed, handles)]
