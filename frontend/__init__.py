"""radixflow: an SGLang-compatible frontend language over the radixflow runtime."""

__version__ = "0.1.0"
