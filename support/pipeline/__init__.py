"""The pipeline lessons' plumbing, under their parent's name (05_pipeline.py): 05b's and
05c's Gantt charts and Chrome traces of timelines, and what a 05c stage keeps.
Importable by 05 and every later file."""
