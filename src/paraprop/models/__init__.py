"""Models used by the demos and benchmarks."""

from paraprop.models.made import MADE
from paraprop.models.masked import MaskedLinear, made_degrees, made_masks
from paraprop.models.pixelcnn import PixelCNN
from paraprop.models.recurrences import LayerChain, MaskedAffineMap

__all__ = ["MADE", "LayerChain", "MaskedAffineMap", "MaskedLinear", "PixelCNN", "made_degrees",
           "made_masks"]
