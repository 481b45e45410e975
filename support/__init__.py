"""Plumbing that teaches nothing: files, progress, launching ranks, logs, checkpoints, GPUs.

The numbered lessons, train.py and bench/ import these modules; nothing here imports a
numbered file. What needs the model stays in train.py or is passed in.
"""
