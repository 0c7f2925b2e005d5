"""Shared test configuration: deterministic hypothesis runs.

Every hypothesis test draws from a fixed seed (`derandomize=True`), so a run is reproducible and
a failure seen once is seen again. `deadline=None` because the first example of a test pays for
torch's lazy initialisation on a slow machine.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "flybatch",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("flybatch")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny kernels: extra intra-op threads only add contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
