"""One intra-op thread for the vision tests: the per-image attention loop over tiny images is
overhead-bound, and extra threads only contend with other work on a 2-core machine."""
from __future__ import annotations

from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)
