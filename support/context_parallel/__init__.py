"""08_context_parallel.py's plumbing: the ring's transfers, its message counts and a ring
of threads. Importable by 08 and every later file."""
