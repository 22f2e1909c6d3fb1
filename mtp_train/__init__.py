"""mtp-train: train speculative-decoding draft heads and measure them with real speculative decoding."""

__version__ = "0.1.0"
