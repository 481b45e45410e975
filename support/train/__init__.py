"""train.py's plumbing: the process grid, config, command line and recipes, checkpoints,
export, the run log, prefetch, the learning-rate schedule, vocabulary padding. Importable
by train.py, 09_plan.py (which plans train.py's settings) and bench/ only, never by a
lesson before 09."""
