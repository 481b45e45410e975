"""01_data.py's plumbing (01b_cleaning.py's too): the flags, text sources, token files,
the splitmix64 keys and a progress line. Importable by 01 and every later file."""
