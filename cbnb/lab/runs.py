"""Moved to `cbnb.telemetry.runs` (the run log lives below the engine, which makes one, and the lab, which fills it);
this module keeps ``cbnb.lab.runs`` working as the same module."""

import sys

from cbnb.telemetry import runs as _m

sys.modules[__name__] = _m
