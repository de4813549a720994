"""selfdraft: lossless speculative decoding with trainable self-drafting heads."""

__version__ = "0.1.0"
