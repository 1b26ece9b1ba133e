"""NeMo-RL names and the seed's functions (``aiosync.compat``), kept as their callers use them."""
