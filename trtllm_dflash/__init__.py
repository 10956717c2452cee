"""DFlash speculative decoding for gpt-oss: checkpoints, quantization, runtimes, engine builds."""

__version__ = "0.1.0"
