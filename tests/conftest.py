"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the duration of a test. Tiny problems only pay synchronisation
    for threads (on a loaded 2-core machine each small batched matmul of ELK's scan then waits
    for a time slice, ~10 ms instead of ~10 us)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CUDA = torch.cuda.is_available()


@pytest.fixture(params=[
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not CUDA, reason="no CUDA device (make test-gpu on a GPU machine)"),
    ]),
])
def device(request) -> torch.device:
    """The device an exactness test runs on: ``cpu`` always, ``cuda`` where a GPU is present
    (those cases carry the ``gpu`` marker: ``make test-gpu`` runs them alone)."""
    return torch.device(request.param)


@pytest.fixture
def ieee_convolutions(monkeypatch, device):
    """cuDNN's float32 convolutions in float32 (not TF32, torch's default on CUDA) for the test,
    on the ``cuda`` case of ``device``; the CPU case is untouched. For the tests whose reference
    and method run convolutions of other shapes or products (see docs/gpu.md, "TF32")."""
    if torch.device(device).type == "cuda":
        monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")
