"""05_pipeline.py's plumbing (05b's and 05c's): Gantt charts and Chrome traces of
timelines, and what a stage keeps. Importable by 05 and every later file."""
