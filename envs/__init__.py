"""Gymnasium environments that wrap speculative decoding with RIFT caches."""
