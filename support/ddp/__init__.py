"""03_ddp.py's plumbing: the gloo exit workaround its hooks share with 07. Importable by
03 and every later file."""
