"""pytest configuration for autopar's tests.

Only two things happen here:

* the repository root goes on ``sys.path`` so ``import autopar`` works
  without installing the package, and ``tests/`` too so test modules can
  ``from distributed import DistPool, dist_pool_fixture`` whatever pytest's
  import mode;
* :func:`dist_pool_fixture` (defined in ``tests/distributed.py``) is
  re-exported for discoverability.  No fixtures are registered globally, and
  no plugin unless ``AUTOPAR_TEST_CPU`` names a file: then
  ``tests/cpu_accounting.py`` writes each test's CPU seconds there.

Multi-process (gloo) tests share one world of each size for the session, reset for each
module (tests/distributed.py: ``shared_pool``)::

    # tests/test_something.py
    from distributed import dist_pool_fixture

    pool4 = dist_pool_fixture(4)            # module-scoped fixture "pool4"

    def _sum_of_ranks():                    # module level: sent by reference
        import torch, torch.distributed as dist
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum(pool4):
        assert pool4.run(_sum_of_ranks) == [6.0] * 4

The explicit equivalent, e.g. to pass other options::

    @pytest.fixture(scope="module")
    def pool8():
        with DistPool(8, timeout_s=600) as pool:
            yield pool

Workers import the test module again: never start a pool at import time of
a test module, only in fixtures or tests.  A failure on any rank breaks the
shared pool for the rest of the module (later runs raise
``DistPoolBrokenError``; the next module gets a new one), so tests that expect a
rank to fail create their own short-lived pool.
"""

import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)

for _path in (_TESTS_DIR, _REPO_ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from distributed import dist_pool_fixture  # noqa: E402,F401  (re-export)


def pytest_configure(config):
    """`AUTOPAR_TEST_CPU=FILE`: write each test's CPU seconds to FILE (tests/cpu_accounting.py)."""
    path = os.environ.get("AUTOPAR_TEST_CPU")
    if path:
        from cpu_accounting import CpuAccounting

        config.pluginmanager.register(CpuAccounting(path), "autopar-cpu-accounting")
