"""Bridges that let other serving engines report into chunkscope's collector."""
