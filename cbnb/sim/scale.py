"""Moved to `cbnb.measure.scale` (the measuring of a machine lives apart from the simulator); this module keeps
``cbnb.sim.scale`` and ``python -m cbnb.sim.scale`` working as the same module."""

import sys

from cbnb.measure import scale as _m

if __name__ == "__main__":  # pragma: no cover
    sys.exit(_m.main())
sys.modules[__name__] = _m
