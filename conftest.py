"""Shared set-up for the docstring examples (``--doctest-modules`` over ``src/paraprop``).

Every docstring example runs with ``torch``, ``nn`` (``torch.nn``), ``F``
(``torch.nn.functional``) and ``paraprop`` already imported, on top of its own module's names,
and starts from ``torch.manual_seed(0)`` (so the outputs it shows are the outputs it gets) on
one PyTorch thread.
"""

import pytest
import torch
from _pytest.doctest import DoctestItem

import paraprop

# Entry points that would run their work when imported (pytest already skips __main__.py files).
collect_ignore = ["src/paraprop/distributed/__main__.py"]


@pytest.fixture(autouse=True)
def _docstring_examples(request):
    """Imports and a fixed seed for doctests; other tests are left exactly as they were."""
    if not isinstance(request.node, DoctestItem):
        yield
        return
    namespace = request.getfixturevalue("doctest_namespace")
    namespace.update(torch=torch, nn=torch.nn, F=torch.nn.functional, paraprop=paraprop)
    state, threads = torch.random.get_rng_state(), torch.get_num_threads()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny examples: one thread is faster, and immune to a busy machine
    yield
    torch.set_num_threads(threads)
    torch.random.set_rng_state(state)
