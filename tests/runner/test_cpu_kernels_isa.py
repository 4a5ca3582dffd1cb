"""The C kernels built without AVX-512 (``-mno-avx512f``: the AVX2 code an AVX2-only CPU runs) give the same bits as
the default build (``-march=native``): their vector loops make more passes over narrower registers but never change
the order of a sum. On a CPU without AVX-512 both builds are AVX2 and the test still checks the build flags work.
``CBNB_KERNEL_CFLAGS=-mno-avx512f`` runs any other test (e.g. the greedy oracle) on the AVX2 build."""

from __future__ import annotations

import platform
import random
import shutil

import pytest
import torch

from cbnb.runner.cpu import cpu_kernels, layer_ops

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None
                                or platform.machine() not in ("x86_64", "AMD64"), reason="needs an x86 C compiler")
AVX2 = ("-mno-avx512f",)


def _paged(extra):
    return cpu_kernels._Paged(cpu_kernels.build_library(cpu_kernels._SRC, extra))


@pytest.mark.parametrize("H, Hkv, D, P", [(9, 3, 64, 256), (9, 3, 64, 16), (16, 4, 64, 8), (4, 1, 64, 5),
                                          (40, 2, 64, 16), (4, 2, 128, 16)])
def test_paged_attention_without_avx512_gives_the_same_bits(H, Hkv, D, P, monkeypatch):
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    spec = [(0, 1), (0, 70), (37, 20), (3, 130), (60, 100)]  # (past, chunk) per prefill row
    width = max(-(-(s + n) // P) for s, n in spec) + 1
    nb = width + 6
    pool = torch.randn(nb, 2, 2, P, Hkv, D, generator=g)
    kp, vp = pool[:, 1, 0], pool[:, 1, 1]
    rows = torch.tensor([sum(n for _, n in spec[:i]) for i in range(len(spec))])
    starts, counts = torch.tensor([s for s, _ in spec]), torch.tensor([n for _, n in spec])
    tables = torch.tensor([rng.sample(range(nb), width) for _ in spec])
    q = torch.randn(int(counts.sum()), H, D, generator=g)
    lens = torch.tensor([rng.randint(1, width * P) for _ in range(7)])
    dtab = torch.tensor([rng.sample(range(nb), width) for _ in range(7)])
    qd = torch.randn(7, H, D, generator=g)
    outs = []
    for extra in ((), AVX2):
        monkeypatch.setattr(cpu_kernels._PAGED, "bound", _paged(extra))
        pre, dec = torch.zeros_like(q), torch.zeros_like(qd)
        cpu_kernels.paged_prefill(q, kp, vp, rows, starts, counts, tables, D ** -0.5, pre)
        cpu_kernels.paged_decode(qd, kp, vp, torch.arange(7), dtab, lens, int(lens.max()), D ** -0.5, dec)
        outs.append((pre, dec))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][0].abs().sum() > 0 and outs[0][1].abs().sum() > 0


def test_layer_ops_without_avx512_give_the_same_bits(monkeypatch):
    g = torch.Generator().manual_seed(4)
    T, n, inter, H, Hkv, D = 37, 576, 1536, 9, 3, 64
    x, r, w = torch.randn(T, n, generator=g), torch.randn(T, n, generator=g), torch.randn(n, generator=g)
    gate, up = torch.randn(T, inter, generator=g) * 6, torch.randn(T, inter, generator=g)
    q, k = torch.randn(T, H * D, generator=g), torch.randn(T, Hkv * D, generator=g)
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    outs = []
    for extra in ((), AVX2):
        lib = layer_ops._bind(cpu_kernels.build_library(layer_ops._LIB.path, layer_ops._LIB.extra + extra))
        monkeypatch.setattr(layer_ops._LIB, "bound", lib)
        monkeypatch.setattr(layer_ops._LIB, "tried", True)
        outs.append([*layer_ops.rms_norm(x, w, 1e-5, residual=r), layer_ops.silu_mul(gate, up),
                     *layer_ops.rope_qk(q, k, cos, sin, H, Hkv)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_kernel_cflags_from_the_environment_are_part_of_the_build(monkeypatch, tmp_path):
    monkeypatch.setenv("CBNB_KERNEL_CACHE", str(tmp_path))
    cpu_kernels.build_library(cpu_kernels._SRC)
    monkeypatch.setenv("CBNB_KERNEL_CFLAGS", "-mno-avx512f -DCBNB_UNUSED=1")
    cpu_kernels.build_library(cpu_kernels._SRC)
    assert len(list(tmp_path.glob("paged_decode-*.so"))) == 2  # another key: no stale library is reused
    monkeypatch.setenv("CBNB_KERNEL_CFLAGS", "-fno-such-flag")
    with pytest.raises(RuntimeError, match="failed"):
        cpu_kernels.build_library(cpu_kernels._SRC)
