"""Refresh controllers: decide when a RIFT cache rescores its history."""
