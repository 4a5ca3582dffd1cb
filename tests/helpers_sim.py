"""Shapes and hardware profiles several simulator and measuring tests share (tests/sim, tests/measure)."""

from __future__ import annotations

from cbnb.sim import HardwareProfile, ModelShape

# h 8, I 16, heads 2 / kv 1, head_dim 4, vocab 100, 2 layers, float32: the cost model's hand-computed cases.
TOY = ModelShape("toy", "llama", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                 head_dim=4, vocab_size=100, dtype="float32")
TOY_CPU = HardwareProfile(name="toy-cpu", kind="cpu", runner="cpu", memory_bytes=1 << 30, peak_flops={"float32": 1e9},
                          memory_bandwidth=1e9, host_device_bandwidth=1e8, step_overhead_s=1e-3,
                          step_overhead_graph_s=5e-4, kernel_launch_s=1e-6, layer_overhead_s=1e-5,
                          attention_call_s=2e-6, request_overhead_s=1e-4, elementwise_bandwidth=2e9)
# A CPU profile for comparing decisions (plans, offloads) with the real engine: its costs only order the steps.
TEST_CPU = HardwareProfile(name="test-cpu", kind="cpu", runner="cpu", memory_bytes=8 << 30,
                           peak_flops={"float32": 1e11}, memory_bandwidth=2e10, host_device_bandwidth=1e10,
                           step_overhead_s=1e-3, step_overhead_graph_s=1e-3, kernel_launch_s=1e-5)
