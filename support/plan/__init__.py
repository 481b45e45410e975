"""09_plan.py's plumbing: its Layout and Plan records, its report, and the GPT shape flags
(--n-layer, ...) that 09 and train.py share. Importable by 09 and what comes after it:
train.py and support/train/."""
