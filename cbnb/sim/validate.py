"""Moved to `cbnb.measure.validate` (the measuring of a machine lives apart from the simulator); this module keeps
``cbnb.sim.validate`` and ``python -m cbnb.sim.validate`` working as the same module."""

import sys

from cbnb.measure import validate as _m

if __name__ == "__main__":  # pragma: no cover
    sys.exit(_m.main())
sys.modules[__name__] = _m
