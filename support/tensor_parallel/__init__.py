"""04_tensor_parallel.py's plumbing (04b's too): sharding helpers, comm counters and the
bytes kept for the backward. Importable by 04 and every later file."""
