"""Exact Jacobi decoding for causal language models (``transformers`` or any module with the
same key/value-cache contract): :func:`generate` returns the sequential loop's tokens, greedy
or sampled, in fewer model passes."""

from paraprop.decoding.accelerate import Accelerated, accelerate
from paraprop.decoding.decode import generate
from paraprop.decoding.processors import choose, process_logits

__all__ = ["Accelerated", "accelerate", "choose", "generate", "process_logits"]
