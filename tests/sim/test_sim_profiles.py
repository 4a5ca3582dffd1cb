"""Hardware profiles: the bundled datasheet figures and their citations, rates and curves, files, and `calibrate()`
(its result is a valid, saveable profile; no speed is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cbnb.sim import PROFILE_NAMES, HardwareProfile, ModelShape, load_profile

GiB = 1 << 30
# Dense figures as derived in the files from the cited datasheets: (memory GiB, bf16 FLOP/s, fp32 FLOP/s, B/s).
DATASHEET = {
    "h100-sxm": (80, 989.5e12, 67e12, 3.35e12),
    "h200": (141, 989.5e12, 67e12, 4.8e12),
    "a100-80gb": (80, 312e12, 19.5e12, 2.039e12),
    "l4": (24, 121e12, 30.3e12, 300e9),
    "rtx-4090": (24, 165.2e12, 82.6e12, 1008e9),
}


def test_bundled_gpu_profiles_carry_datasheet_figures_and_cite_them():
    assert set(PROFILE_NAMES) == set(DATASHEET) | {"cpu"}
    for name, (mem, bf16, fp32, bw) in DATASHEET.items():
        p = load_profile(name)
        assert p.kind == "gpu" and p.runner == "cuda" and p.device_type == "cuda"
        assert p.memory_bytes == mem * GiB
        assert p.peak("bfloat16") == bf16 and p.peak("float32") == fp32 and p.memory_bandwidth == bw
        for figure in ("memory_bytes", "peak_flops", "memory_bandwidth", "host_device_bandwidth"):
            assert "https://" in p.sources[figure], (name, figure)
        for figure in ("step_overhead_s", "kernel_launch_s", "flops_efficiency", "bandwidth_efficiency"):
            assert p.sources[figure].startswith("assumed"), (name, figure)  # stated as assumptions, not facts
        assert p.host_device_bandwidth < p.memory_bandwidth
    assert load_profile("h200").memory_bandwidth > load_profile("h100-sxm").memory_bandwidth


def test_rates_efficiency_and_tf32():
    p = load_profile("a100-80gb")
    assert p.gemm_rate("bf16", 512) == pytest.approx(312e12 * p.flops_efficiency)
    assert p.bandwidth == pytest.approx(2.039e12 * p.bandwidth_efficiency)
    assert p.peak("float32") == 19.5e12 and p.replace(allow_tf32=True).peak("float32") == 156e12
    assert p.free_bytes(10 * GiB) == 80 * GiB - p.reserved_bytes - 10 * GiB
    assert p.layer_launch_s == pytest.approx(p.layer_kernels * p.kernel_launch_s)


def test_measured_curve_interpolates_in_log_rows():
    p = load_profile("l4").replace(gemm_flops={"float32": [[1, 1e9], [4, 3e9], [64, 9e9]]})
    assert p.gemm_rate("float32", 1) == 1e9
    assert p.gemm_rate("float32", 2) == pytest.approx(2e9)  # halfway in log2 between 1 and 4
    assert p.gemm_rate("float32", 16) == pytest.approx(6e9)  # halfway in log2 between 4 and 64
    assert p.gemm_rate("float32", 1000) == 9e9  # held beyond the last point
    assert p.gemm_rate("bfloat16", 8) == pytest.approx(121e12 * p.flops_efficiency)  # no curve: peak * efficiency
    assert p.attention_rate("float32", 4) == p.gemm_rate("float32", 4)
    # A bandwidth curve is held (not scaled) below its first point.
    e = p.replace(elementwise_curve={"float32": [[16, 4e10], [256, 2e10]]})
    assert e.elementwise_rate("float32", 1) == 4e10 and e.elementwise_rate("float32", 64) == pytest.approx(3e10)
    assert e.elementwise_rate("float32", 4096) == 2e10
    assert p.elementwise_rate("float32", 64) == p.bandwidth  # no curve, no figure: the memory bandwidth


def test_files_round_trip_and_errors(tmp_path, monkeypatch):
    p = load_profile("h100-sxm")
    path = p.save(tmp_path / "x.json")
    assert load_profile(str(path)) == p and HardwareProfile.from_dict(json.loads(path.read_text())) == p
    with pytest.raises(ValueError, match="unknown HardwareProfile field.*bogus"):
        HardwareProfile.from_dict({**p.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu-v9'.*h100-sxm"):
        load_profile("tpu-v9")
    monkeypatch.setenv("CBNB_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"run cbnb.measure.calibrate\(\)"):
        load_profile("cpu")
    with pytest.raises(ValueError, match="reserved_bytes"):
        p.replace(reserved_bytes=p.memory_bytes)
    with pytest.raises(ValueError, match="runner"):
        p.replace(runner="tpu")


TOY = ModelShape("toy", "llama", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                 head_dim=16, vocab_size=512, dtype="float32")


def _valid_measured(p: HardwareProfile) -> None:
    assert p.kind == "cpu" and p.runner == "cpu" and p.name == "cpu"
    assert p.memory_bandwidth > 0 and p.host_device_bandwidth > 0 and p.peak("float32") > 0
    rows = [m for m, _ in p.gemm_flops["float32"]]
    assert rows == sorted(rows) and rows[0] == 1
    for f in ("step_overhead_s", "kernel_launch_s", "layer_overhead_s", "attention_call_s", "request_overhead_s"):
        assert getattr(p, f) >= 0, f
    assert all(v.startswith("measured by cbnb.measure.calibrate") for v in p.sources.values())


def test_calibrate_quick_gives_a_saveable_cpu_profile(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from cbnb.measure import calibrate

    monkeypatch.setenv("CBNB_CACHE_DIR", str(tmp_path))
    p = calibrate(TOY, quick=True)
    _valid_measured(p)
    assert "torch" in p.notes and "calibrated at shape toy" in p.notes
    # the prefill path over a past is measured (call + per key + FLOPs), with its method in the sources
    assert p.past_attention_flops > 0 and p.past_attention_key_s >= 0 and p.past_attention_call_s >= 0
    assert "masked attention" in p.sources["past_attention_flops"]
    assert load_profile("cpu") == p  # saved where load_profile("cpu") looks
    assert (tmp_path / "sim" / "cpu.json").is_file()


def test_calibrate_without_torch_uses_numpy(tmp_path):
    code = ("import sys\nfor m in ('torch', 'transformers'): sys.modules[m] = None\n"
            "from cbnb.measure import calibrate\nfrom cbnb.sim import ModelShape\n"
            "s = ModelShape('toy', 'llama', 2, 64, 128, 4, 2, 16, 512, dtype='float32')\n"
            f"p = calibrate(s, quick=True, save={str(tmp_path / 'cpu.json')!r})\n"
            "print(p.notes)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert "numpy" in out.stdout and "estimated" in out.stdout
    _valid_measured(load_profile(str(tmp_path / "cpu.json")))


def test_profile_for_device_maps_cuda_names_to_bundled_profiles():
    from cbnb.sim.profiles import PROFILE_NAMES, profile_for_device

    assert profile_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert profile_for_device("NVIDIA H200") == "h200"
    assert profile_for_device("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert profile_for_device("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert profile_for_device("NVIDIA L4") == "l4"
    assert profile_for_device("NVIDIA L40S") is None and profile_for_device("Tesla T4") is None
    assert {p for p in ("h100-sxm", "h200", "a100-80gb", "rtx-4090", "l4")} <= set(PROFILE_NAMES)
