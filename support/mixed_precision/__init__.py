"""06_mixed_precision.py's plumbing: GradScaler's state format. Importable by 06 and every
later file."""
