"""Models that the documented API, the tests, the demos and the benchmarks name (MADE, PixelCNN,
TarFlow, the denoisers, the char LM, the reference triangular systems)."""

from paraprop.models.classifier import RecurrentClassifier
from paraprop.models.denoisers import MLPDenoiser, small_unet
from paraprop.models.densenet import small_densenet
from paraprop.models.made import MADE
from paraprop.models.masked import MaskedLinear, made_degrees, made_masks
from paraprop.models.mlp import deep_mlp
from paraprop.models.pixelcnn import PixelCNN
from paraprop.models.synthetic import LayerChain, MaskedAffineMap
from paraprop.models.tarflow import TarFlow

__all__ = ["MADE", "LayerChain", "MLPDenoiser", "MaskedAffineMap", "MaskedLinear", "PixelCNN",
           "RecurrentClassifier", "TarFlow", "deep_mlp", "made_degrees", "made_masks",
           "small_densenet", "small_unet"]
