"""The CPU runner's forward for Llama-shaped decoder layers: the same GEMMs, far fewer torch ops between them.

Why: in eager torch, transformers' ``LlamaDecoderLayer`` runs about 60 ATen ops around its 4 fused GEMMs: RMSNorm
is 7 ops twice, the rotary embedding about 16 on strided ``[1, H, T, D]`` views, the attention function transposes
q back and copies it, the MLP's SiLU and product are two passes over the widest activation. On a 2-core CPU these
cost more than their arithmetic: per 30 layers of SmolLM2, about 1.5 ms of rotary alone in a 32-row decode step and
7 ms in a 512-token prefill step (2026-12-06, the project's EPYC; `cbnb.runner.cpu.layer_ops`). Here a layer is: RMSNorm
(C), q/k/v (one GEMM, `cbnb.runner.cpu.cpu_linear`), rotary (C, writing q and k in the ``[T, H, D]`` layout the paged
attention reads), the paged attention (`cbnb.runner.cpu.attention.paged_attention`, called directly), o_proj,
residual add + RMSNorm (one C pass), gate/up (one GEMM), SiLU * up (C), down_proj, residual add: what vLLM's model
files do with its fused kernels.

How: `route(model)` gives each decoder layer of a class in `ROUTED` whose parts match (attention with the four
projections and no q/k norms, whose module's ``apply_rotary_pos_emb`` equals the C rotary bit for bit on a random
probe; RMSNorm; gated SiLU MLP) its own ``forward``. That forward takes the fast path only inside cbnb's eager CPU
forward (the step's batch passed as ``cbnb_batch``; the model's attention set to cbnb's paged CPU attention; float32;
batch size 1; no transformers cache); any other call (the user's own ``model.generate``, a compiled forward, the
CUDA runner's forward) runs the class forward unchanged. Results: the rotary, the
adds and the K/V write are the same bits as transformers'; RMSNorm and SiLU agree to float32 rounding (another
summation order, another exp), like the decode kernel, and the greedy oracle holds with the route on and off
(``CBNB_CPU_KERNELS=0`` routes nothing with the rest of the CPU fast path; ``CBNB_CPU_LAYERS=0`` this part alone).
`unroute` restores the class forward. Python per layer is kept short (it runs 30 times a step, single-threaded, while
the cores that run the GEMMs wait): the fused q/k/v and gate/up GEMMs are one call each (`cpu_linear.sibling_outputs`,
not one module call per projection), the paged attention is called with ``[T, H, D]`` tensors (no transformers
attention-interface wrapper), and the conditions that hold for a whole step are checked at its first layer only.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from typing import Any

import torch

from . import cpu_linear, layer_ops
from .attention import ATTN_NAME, paged_attention

__all__ = ["ROUTED", "wanted", "route", "unroute", "routed"]

#: Decoder-layer classes whose forward is transformers' Llama pattern (pre-norm attention and gated-SiLU MLP with
#: residual adds; rotate_half rotary; no sliding window, soft-capping or extra norms).
ROUTED = ("LlamaDecoderLayer",)
_MARK = "_cbnb_layer"
_local = threading.local()


def _attention(attn: torch.nn.Module, h: torch.Tensor, heads: tuple[int, int], cos: torch.Tensor, sin: torch.Tensor,
               batch: Any) -> torch.Tensor:
    """o_proj(paged attention(rotary(q, k), v)) of the normed rows `h` ``[T, hidden]``; returns ``[T, hidden]``."""
    T = h.shape[0]
    # The runner's linears: one fused GEMM; q, k and v are slices of its output (cbnb.runner.cpu.cpu_linear).
    q, k, v = cpu_linear.sibling_outputs([attn.q_proj, attn.k_proj, attn.v_proj], h)
    q, k = layer_ops.rope_qk(q, k, cos, sin, heads[0], heads[1])  # [T, H, D], [T, Hkv, D]
    out = paged_attention(batch, attn.layer_idx, q, k, v.view(T, heads[1], -1), attn.scaling)
    return attn.o_proj(out.reshape(T, -1))


def _mlp(mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """down_proj(silu(gate_proj(h)) * up_proj(h)), gate and up from one fused GEMM where the runner fuses them."""
    g, u = cpu_linear.sibling_outputs([mlp.gate_proj, mlp.up_proj], h)
    return mlp.down_proj(layer_ops.silu_mul(g, u))


def _fast(self: torch.nn.Module, hs: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    cos, sin = kwargs["position_embeddings"]
    x = hs[0]  # [T, hidden]
    n_in, n_post = self.input_layernorm, self.post_attention_layernorm
    _, h = layer_ops.rms_norm(x, n_in.weight, n_in.variance_epsilon)
    a = _attention(self.self_attn, h, self.__dict__[_MARK], cos[0], sin[0], kwargs["cbnb_batch"])
    x, h = layer_ops.rms_norm(a, n_post.weight, n_post.variance_epsilon, residual=x)  # x + a, then its norm
    return (x + _mlp(self.mlp, h)).unsqueeze(0)


def _step_ok(self: torch.nn.Module, kwargs: dict[str, Any], pe: Any) -> bool:
    """The conditions of the fast path that hold for a whole step (its batch, position embeddings, the model's
    attention); checked at the step's first layer and remembered for the others (same batch and cos object)."""
    batch = kwargs.get("cbnb_batch")
    held = getattr(_local, "step", None)
    if held is not None and held[0] is batch and held[1] is pe[0]:
        return held[2]
    ok = (batch is not None and not kwargs.get("cbnb_compiled") and kwargs.get("cache") is None
          and kwargs.get("past_key_values") is None and not torch.is_grad_enabled()
          and pe[0].dtype == torch.float32 and pe[0].dim() == 3 and pe[0].shape[0] == 1 and pe[0].stride(-1) == 1
          and pe[1].stride() == pe[0].stride() and self.self_attn.config._attn_implementation == ATTN_NAME
          and layer_ops.available())
    # The batch and cos are kept until the next step's first layer (identity, not id(): no reuse after free).
    _local.step = (batch, pe[0], ok)
    return ok


def _forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    hs = args[0] if len(args) == 1 else (kwargs.get("hidden_states") if not args else None)
    pe = kwargs.get("position_embeddings")
    if (hs is not None and pe is not None and hs.dtype == torch.float32 and hs.dim() == 3 and hs.shape[0] == 1
            and hs.stride(-1) == 1 and kwargs.get("cbnb_batch") is not None and _step_ok(self, kwargs, pe)):
        return _fast(self, hs, kwargs)
    return type(self).forward(self, *args, **kwargs)


def _norm_ok(norm: Any, n: int) -> bool:
    w = getattr(norm, "weight", None)
    return (type(norm).__name__.endswith("RMSNorm") and isinstance(getattr(norm, "variance_epsilon", None), float)
            and isinstance(w, torch.Tensor) and w.shape == (n,) and w.dtype == torch.float32)


def _heads(layer: torch.nn.Module) -> tuple[int, int] | None:
    """(heads, kv heads) when `layer` has the structure the fast forward assumes, else None."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    cfg = getattr(attn, "config", None)
    lin = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mlin = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if cfg is None or not all(isinstance(x, torch.nn.Linear) for x in lin + mlin) or hasattr(attn, "q_norm") \
            or hasattr(attn, "k_norm") or not isinstance(getattr(attn, "scaling", None), float) \
            or type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return None
    hidden = lin[0].in_features
    if not (_norm_ok(getattr(layer, "input_layernorm", None), hidden)
            and _norm_ok(getattr(layer, "post_attention_layernorm", None), hidden)):
        return None
    d = getattr(attn, "head_dim", None)
    h, hkv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if not (isinstance(d, int) and isinstance(h, int) and isinstance(hkv, int) and d % 2 == 0):
        return None
    if lin[0].out_features != h * d or lin[1].out_features != hkv * d or lin[2].out_features != hkv * d \
            or mlin[0].out_features != mlin[1].out_features:
        return None
    if getattr(cfg, "attn_logit_softcapping", None) or (getattr(cfg, "sliding_window", None)
                                                         and getattr(cfg, "use_sliding_window", True)):
        return None
    return h, hkv


_checked: dict[Any, bool] = {}


def _rotary_matches(module_name: str, d: int) -> bool:
    """Whether the model module's ``apply_rotary_pos_emb`` gives the C rotary's bits on a random probe."""
    key = (module_name, d)
    if key not in _checked:
        fn = getattr(sys.modules.get(module_name), "apply_rotary_pos_emb", None)
        ok = False
        if fn is not None:
            gen = torch.Generator().manual_seed(0)
            qkv = torch.randn(5, 6 * d, generator=gen) * 4
            ang = torch.randn(5, d // 2, generator=gen) * 50
            emb = torch.cat([ang, ang], -1)
            cos, sin = emb.cos(), emb.sin()
            q, k = qkv[:, :4 * d], qkv[:, 4 * d:5 * d]
            try:
                with torch.no_grad():
                    wq, wk = fn(q.view(1, 5, 4, d).transpose(1, 2), k.view(1, 5, 1, d).transpose(1, 2), cos[None],
                                sin[None])
                gq, gk = layer_ops.rope_qk(q, k, cos, sin, 4, 1)
                ok = torch.equal(wq[0].transpose(0, 1), gq) and torch.equal(wk[0].transpose(0, 1), gk)
            except Exception:
                ok = False
        _checked[key] = ok
    return _checked[key]


def wanted() -> bool:
    """False when ``CBNB_CPU_LAYERS=0`` (read at every `route`)."""
    return os.environ.get("CBNB_CPU_LAYERS", "1") not in ("0", "false", "off", "no")


def route(model: torch.nn.Module) -> int:
    """Give the model's eligible decoder layers the fast forward (idempotent); returns how many are routed
    (0 with the CPU fast path or this part off, or without the layer ops)."""
    if not (wanted() and layer_ops.available()):
        return 0
    n = 0
    for m in model.modules():
        if type(m).__name__ not in ROUTED:
            continue
        if _MARK not in m.__dict__:
            heads = _heads(m)
            if heads is None or "forward" in m.__dict__ \
                    or not _rotary_matches(type(m.self_attn).__module__, m.self_attn.head_dim):
                continue
            m.forward = types.MethodType(_forward, m)
            m.__dict__[_MARK] = heads
        n += 1
    return n


def routed(model: torch.nn.Module) -> int:
    """How many of the model's decoder layers have the fast forward."""
    return sum(_MARK in m.__dict__ for m in model.modules())


def unroute(model: torch.nn.Module) -> None:
    """Give the model's decoder layers back their class ``forward``."""
    for m in model.modules():
        if m.__dict__.pop(_MARK, None) is not None:
            m.__dict__.pop("forward", None)
