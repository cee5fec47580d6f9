"""rift-ada: KV-cache compression of the draft model in speculative decoding."""

__version__ = "0.1.0"
