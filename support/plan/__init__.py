"""09_plan.py's plumbing: its Layout and Plan records and its report. Importable by 09,
train.py and bench/."""
