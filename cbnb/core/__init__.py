"""`cbnb.core`: the deciding side, torch-free: the config, requests and sampling parameters, the plain step data
(`plan`), the scheduler, the offload policy, the `EngineCore` (`engine_core`), run segments, generation-config
defaults and the KV cache (`cbnb.core.cache`). Nothing here imports the engine, the runner or the UI."""
