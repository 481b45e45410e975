"""Plumbing that teaches nothing, grouped by owner: a path says who may import it.

- Top level (distributed, files, gpus, meta; frozen_corpus.txt, the demos' text): shared,
  any file may import it.
- A package named after a parent lesson (data/ for 01_data.py, ddp/, tensor_parallel/,
  pipeline/, mixed_precision/, context_parallel/, plan/): that lesson's plumbing and its
  lettered extensions' (05b's Gantt charts live in pipeline/), importable by it and later
  files.
- train/: train.py's plumbing, importable by train.py, 09_plan.py and bench/ only.

Nothing here imports a numbered file; tests/test_house.py checks the rules.
"""
