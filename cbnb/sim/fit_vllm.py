"""Moved to `cbnb.measure.fit_vllm` (the measuring of a machine lives apart from the simulator); this module keeps
``cbnb.sim.fit_vllm`` working as the same module."""

import sys

from cbnb.measure import fit_vllm as _m

sys.modules[__name__] = _m
