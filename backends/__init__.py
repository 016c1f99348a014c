"""Backends: the ops interface (`dsv41.backends.ops`), its dispatch, and per-device platforms."""
