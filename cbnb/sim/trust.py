"""What a hardware profile's predictions can be trusted for (`cbnb.sim.profiles.HardwareProfile.trust`): the words
for each kind of profile, the last published validation's errors a calibrated profile quotes, and how a calibrated
profile's sources begin. Data only."""

from __future__ import annotations

from typing import Any

__all__ = ["TRUST_TEXT", "VALIDATION", "CALIBRATED_PREFIXES"]

#: How `cbnb.measure.calibrate` begins each of a profile's `sources` (and, before 2026-12, ``cbnb.sim.calibrate``):
#: what marks a profile as calibrated when it names no provenance.
CALIBRATED_PREFIXES = ("measured by cbnb.measure.calibrate", "measured by cbnb.sim.calibrate")

#: What each kind of profile's predictions can be trusted for (printed with every simulated run's provenance).
TRUST_TEXT = {
    "datasheet": ("datasheet figures with assumed efficiencies and overheads, never checked on the device: good for "
                  "what changes with the config (which option fits more requests, where the cache runs out, the "
                  "shape of a curve), not for absolute latencies; differences of a few percent mean nothing"),
    "calibrated": ("measured on this CPU by calibrate(): absolute step times within the validation errors (the "
                   "last validate run's figures) on a quiet machine, for cbnb's own engine here"),
    "custom": "a profile made by hand: its figures are what was typed in, with no check against a device",
    "fitted": ("efficiencies and step cost fitted to your vLLM benchmark runs: absolute throughput and latency "
               "within the fit's leave-one-out error for traffic like the runs it was fitted on; extrapolating "
               "to much longer prompts, other models or other GPUs is not covered"),
    "fitted-public": ("efficiencies and step cost fitted to public vLLM measurements of an 8B model in bfloat16 "
                      "(cbnb/sim/data/public/vllm_points.json; python -m cbnb.measure.validate --gpu): absolute "
                      "latency and throughput within the leave-one-out error for one-GPU traffic like those points; "
                      "other models, much longer prompts and vLLM's own scheduling decisions are not covered"),
}

#: The last published ``python -m cbnb.measure.validate`` (README, the last of three runs of 2026-12-06, ``--threads 2``,
#: the 2-core development machine): per-workload median |per-step error| and signed wall-time error, percent. A
#: calibrated CPU profile's `trust()` quotes them; its ``error_pct`` is the largest |wall error| of that day's three
#: runs (the two earlier ones missed the wall target where the machine had slowed down after the calibration).
VALIDATION: dict[str, Any] = {
    "source": "python -m cbnb.sim.validate --threads 2 --repeat 3, 2026-12-06 07:41 (packed oneDNN linears, "
              "rewritten decode kernel, decoder layers with C ops, the C prefill kernel), 2-core development machine "
              "(README); wall_error_pct_max over that day's runs at 02:23, 03:02, 03:20, 05:31 and 07:41",
    "step_error_pct_p50": {"cpu-32": 9.0, "long-gen": 4.7, "shared-prefix": 7.0, "cpu-poisson": 8.9},
    "wall_error_pct": {"cpu-32": 7.5, "long-gen": -5.8, "shared-prefix": 6.8, "cpu-poisson": -0.5},
    "wall_error_pct_max": 15.1,
}
