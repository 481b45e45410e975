"""01_data.py's plumbing (01b_cleaning.py's too): the flags, text sources, token files
(with their progress line) and the splitmix64 keys. Importable by 01 and every later file."""
