import os
import shutil

import torch

# Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter. Triton reads
# this when a kernel is decorated, so it must be set before dlm_ops (and its kernels) is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from dlm_ops.backends import base  # noqa: E402

# "ci" keeps the whole suite within ~10 minutes on 2 cores and replays the same examples on every
# run; "thorough" explores (DLM_HYPOTHESIS_PROFILE=thorough).
settings.register_profile("ci", max_examples=50, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("DLM_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Backends allocate their outputs NaN-filled during tests: an unwritten element fails."""
    monkeypatch.setattr(base, "POISON_OUTPUTS", True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cxx():
    """A host C++ compiler (CXX, else g++ / c++ / clang++), or the test is skipped."""
    found = os.environ.get("CXX") or next(
        filter(None, map(shutil.which, ("g++", "c++", "clang++"))), None)
    if found is None:
        pytest.skip("no C++ compiler (CXX, g++, c++ or clang++)")
    return found
