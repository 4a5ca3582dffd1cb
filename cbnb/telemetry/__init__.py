"""`cbnb.telemetry`: what the engine records, torch-free: the `Recorder` (`cbnb.telemetry.recorder`), typed events
and the `EventLog` (`events`), run statistics (`stats`) and a request's story (`explain`). It observes the core and
the cache; it never calls back into them."""
