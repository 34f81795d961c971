"""Paged attention: ``common`` plumbing, one module per backend, ``select`` picks one."""
