"""`cbnb.engine`: the engine around the core: `Engine` (`cbnb.engine.engine`, the public `cbnb.Engine`), the shell
both engines share, its protocol (`engine_like`), the loop thread and its phases, the inbox, request handles, prompt
forms, the step mode, stop strings, incremental detokenization, structured output, the builder of one config's
parts and model loading (`models`: `cbnb.load_model`).

Empty on purpose: `import cbnb.engine.inbox` (or any torch-free module here) does not load torch."""
