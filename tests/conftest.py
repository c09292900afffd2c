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
def device(request, monkeypatch) -> torch.device:
    """The device an exactness test runs on: ``cpu`` always, ``cuda`` where a GPU is present
    (those cases carry the ``gpu`` marker: ``make test-gpu`` runs them alone).

    The ``cuda`` case runs cuDNN's float32 convolutions and RNNs in float32 (torch's default
    there is TF32, about ``2**-11``): these tests hold paraprop to its float32 bounds against
    float32 references. What TF32 does to each promise is tested by name, on the GPU, in
    ``tests/test_gpu_tf32.py`` (docs/gpu.md, "TF32")."""
    if request.param == "cuda":
        cudnn = torch.backends.cudnn
        monkeypatch.setattr(cudnn.conv, "fp32_precision", "ieee")
        monkeypatch.setattr(cudnn.rnn, "fp32_precision", "ieee")
    return torch.device(request.param)

