"""`cbnb.tuning`, the public name of `cbnb.lab.tuning` (run_workload, sweep, best, ...): this module is that module
(``cbnb.tuning is cbnb.lab.tuning``), so attributes set on either are seen through both."""

import sys

from .lab import tuning as _tuning

sys.modules[__name__] = _tuning
