"""Where the text comes from: the standard library, files, folders, globs, JSON lines.

Plumbing for 01_data.py, which teaches what happens to documents once they are read:
finding the files, skipping binaries and generated tables, parsing JSON lines, each
document's byte offsets, which bytes are val (the tail), and the one download a user
may ask for.
"""

import codecs
import contextlib
import glob
import json
import sysconfig
import urllib.request
from pathlib import Path

import regex

from support.files import atomic_write

# A file is read whole, about 20 times its size in memory: a bigger one is refused.
MAX_DOCUMENT_BYTES = 32_000_000
SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/"
    "data/tinyshakespeare/input.txt"
)


def is_table(text: str) -> bool:
    """Generated data, not code: over 60% of code lines open with a string or number.

    Charmap codecs, pydoc_data/topics.py and the Unicode and locale tables do;
    hand-written Python scores under 30%.
    """
    lines = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            lines.append(line)
    literal = regex.compile(r"""\s*(?:[rbuRBU]?['"]|[-+]?\d)""")
    return sum(bool(literal.match(s)) for s in lines) > 0.6 * len(lines)


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted, without tests, site-packages and
    generated tables (`is_table`: ~20% of the bytes), so a model trained on it writes
    Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = []
    for f in sorted(root.rglob("*.py")):
        if skip & set(f.relative_to(root).parts):
            continue
        if not is_table(f.read_text("utf-8", errors="replace")):
            files.append(f)
    return files


def is_binary(raw: bytes) -> bool:
    """A NUL, or bytes that are not UTF-8, in the first 8 KB (git sniffs 8,000).

    PNG, ELF and random bytes are binary. Only the head is judged: a stray bad byte
    deep in a text file becomes U+FFFD.
    """
    head = raw[:8192]
    # subtle: the 8 KB cut can split a character; unless the file ends there, the
    # incremental decoder waits for the rest of it instead of failing.
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(raw) <= 8192)
    except UnicodeDecodeError:
        return True
    return b"\0" in head


def source_files(source: str) -> list[Path]:
    """Resolve --source to a sorted list of files, or fail with a message that says how.

    "stdlib" is the standard library's source; "shakespeare" is tiny-shakespeare,
    downloaded once (the only source that needs the network, and only when named);
    otherwise a file, a folder (every file under it) or a glob.
    """
    if source == "stdlib":
        return stdlib_files()
    if source == "shakespeare":
        return [download_shakespeare()]
    path = Path(source)
    if path.is_dir():
        found = path.rglob("*")
    elif path.is_file():
        found = [path]
    else:
        found = map(Path, glob.glob(source, recursive=True))
    files = sorted(f for f in found if f.is_file())
    if not files:
        why = "is not a file, a folder with files or a glob"
        raise FileNotFoundError(f"source {source!r} {why}")
    return files


def json_text(line: bytes, field: str, where: str) -> str:
    """A JSON line's string `field`; a lone surrogate becomes U+FFFD, as in tiktoken."""
    with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
        text = json.loads(line)[field]
        if isinstance(text, str):
            return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    raise ValueError(f"{where}: not a JSON object with a string field {field!r}")


def iter_documents(files, skipped: list, text_field: str = "text"):
    """(start, end, text, whole) per document, in order: a whole file, or one .jsonl
    line's `text_field`. start and end are its bytes in the source (the files one after
    another); whole says it must never be split. Binary files go to `skipped`."""
    offset = 0
    for f in map(Path, files):
        jsonl = f.suffix == ".jsonl"
        if not jsonl and f.stat().st_size > MAX_DOCUMENT_BYTES:
            why = "over 32 MB, one document: split it in files or .jsonl lines"
            raise ValueError(f"{f}: {why}")
        with open(f, "rb") as file:
            if not jsonl:
                raw = file.read()
                if is_binary(raw):  # Skipped: its bytes are no part of the source.
                    skipped.append(f)
                    continue
                text = raw.decode("utf-8", errors="replace")
                yield offset, offset + len(raw), text, False
                offset += len(raw)
                continue
            for n, raw in enumerate(file, 1):
                if raw.strip():
                    text = json_text(raw, text_field, f"{f}:{n}")
                    yield offset, offset + len(raw), text, True
                offset += len(raw)


def text_bytes(files) -> int:
    """The bytes of the files that are not binary (only their heads are read)."""
    total = 0
    for f in files:
        with open(f, "rb") as file:
            head = file.read(
                8193
            )  # is_binary judges 8 KB and asks whether more follows.
        if not is_binary(head):
            total += Path(f).stat().st_size
    return total


def val_cut(files, val_fraction: float) -> int:
    """Where val starts: the byte after the first 1 - val_fraction of the text."""
    return int(text_bytes(files) * (1 - val_fraction))


def split_document(doc, cut: int) -> list:
    """[(split, text)]: val is the source from byte `cut` on.

    A file across the cut is cut at the next newline, so one big file gets a val split
    too; a JSON line stays whole, in train.
    """
    start, end, text, whole = doc
    if start >= cut:
        return [("val", text)]
    if end <= cut or whole:
        return [("train", text)]
    head = text.encode()[: cut - start]
    at = len(head.decode("utf-8", errors="ignore"))  # The cut, in characters.
    # subtle: not at the last character, or a one-line file would get an empty val.
    newline = text.find("\n", at, len(text) - 1)
    if newline >= 0:
        at = newline + 1
    return [("train", text[:at]), ("val", text[at:])]


def train_head(files, val_fraction: float, max_chars: int, text_field="text") -> list:
    """The train split's first `max_chars` characters, as a list of documents: one
    pass over the source that stops there. Binary files are skipped silently."""
    cut = val_cut(files, val_fraction)
    texts = []
    left = max_chars
    for doc in iter_documents(files, [], text_field):
        train = [t for split, t in split_document(doc, cut) if split == "train"]
        texts.append("".join(train)[:left])
        left -= len(texts[-1])
        if left <= 0 or doc[1] >= cut:  # Full, or the train split is over.
            break
    return texts


def check_some_text(source, files, skipped: list, any_text: bool) -> None:
    """A one-line error when the source held no text: every file binary, or blank."""
    if any_text:
        return
    why = f"{len(skipped)} of {len(files)} files binary (NUL or not UTF-8)"
    if not skipped:
        why = "empty or whitespace only"
    raise ValueError(f"source {source!r} holds no text: {why}; nothing to tokenize")


def download_shakespeare(cache_dir="data/downloads") -> Path:
    """Fetch tiny-shakespeare once into a cache (only when the user asks for it)."""
    path = Path(cache_dir) / "tinyshakespeare.txt"
    try:
        if not path.is_file():
            with urllib.request.urlopen(SHAKESPEARE_URL, timeout=20) as r:
                atomic_write(path, lambda tmp: tmp.write_bytes(r.read()))
    except OSError as e:  # urllib's URLError is an OSError.
        fix = "if you are offline, give 01_data.py a local text file: --source FILE"
        fix += f" (or put the text at {path})"
        why = f"could not download tiny-shakespeare from {SHAKESPEARE_URL} ({e})"
        raise RuntimeError(f"{why}; {fix}") from e
    return path
