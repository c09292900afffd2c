"""Models used by the demos and benchmarks."""

from paraprop.models.recurrences import (
    LayerChain,
    MaskedAffineMap,
    MaskedLinear,
    made_degrees,
    made_masks,
)

__all__ = ["LayerChain", "MaskedAffineMap", "MaskedLinear", "made_degrees", "made_masks"]
