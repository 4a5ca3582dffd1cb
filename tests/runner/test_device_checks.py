"""The CUDA path's environment checks (`cbnb.runner.cuda.device_checks`): the 1-element Triton launch (under Triton's
interpreter here), the attention fallback it drives, and the sync-debug guard."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cbnb.runner.cuda import device_checks as dc  # noqa: E402


def test_triton_launch_check_runs_a_kernel(monkeypatch):
    monkeypatch.setattr(dc, "_CHECKED", {})
    monkeypatch.setattr(dc, "_KERNEL", None)
    assert dc.triton_launch_check("cpu") == (True, "")
    tools = dc.build_tools()
    assert set(tools) == {"cc", "gcc", "python_h", "python_include"}


def test_triton_launch_failure_is_a_reason_not_an_exception(monkeypatch):
    class Broken:
        def __getitem__(self, grid):
            def launch(*args):
                raise RuntimeError("Failed to compile the launcher: gcc not found")
            return launch

    monkeypatch.setattr(dc, "_CHECKED", {})
    monkeypatch.setattr(dc, "_KERNEL", Broken())
    ok, why = dc.triton_launch_check("cpu")
    assert not ok and "gcc not found" in why and "Python.h" in why
    assert dc.triton_launch_check("cpu") == (ok, why)  # cached: launched once per process and device


def test_pick_attention_falls_back_to_the_reference(monkeypatch):
    monkeypatch.delenv("CBNB_ATTENTION", raising=False)
    cuda = torch.device("cuda")
    assert dc.pick_attention(cuda, check=lambda d: (True, "")) == ("triton", "")
    att, why = dc.pick_attention(cuda, check=lambda d: (False, "a 1-element Triton kernel failed to launch: X"))
    assert att == "torch" and "failed to launch: X" in why and "PyTorch reference" in why
    assert dc.pick_attention(torch.device("cpu"))[0] == "torch"
    monkeypatch.setenv("CBNB_ATTENTION", "torch")
    assert dc.pick_attention(cuda, check=lambda d: pytest.fail("no probe when forced")) == ("torch", "requested")
    monkeypatch.setenv("CBNB_ATTENTION", "flash")
    with pytest.raises(ValueError, match="CBNB_ATTENTION"):
        dc.pick_attention(cuda)


def test_sync_debug_is_a_no_op_without_cuda_or_mode():
    with dc.sync_debug(None):
        pass
    if not torch.cuda.is_available():
        with dc.sync_debug("error"):
            assert torch.ones(1).item() == 1.0
