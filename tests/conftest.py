"""Shared pytest configuration.

Multi-process tests carry the ``multiprocess`` marker; everything binds 127.0.0.1 only.
"""
