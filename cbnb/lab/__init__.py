"""`cbnb.lab`: the tuning lab, torch-free: traffic (arrivals, lengths, traces, Mooncake), workloads, the driver, SLO
metrics, the run log, tuning (`run_workload`, `sweep`, `best`; also importable as `cbnb.tuning`), load sweeps
(``python -m cbnb.lab.load_sweep``) and transformers' continuous batching as a peer. Exports stay `cbnb.export`."""
