"""A ``.json`` file's top level, and the items of a top-level array read one at a time.

Hugging Face ``datasets`` writes ``to_json(path)`` as JSON lines (one object a line) and
``to_json(path, lines=False)`` as one array of objects; both are commonly named ``.json``. An
array is streamed: its items are decoded from a buffer that holds the current item and one read
ahead (:func:`array_items`), so a 1 GB file is not held in memory whole (json.load of it took
several times its size). Nothing here knows of records or fields: :mod:`bigtrain.data.documents`
reads the text of each item.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 20  # bytes read at a time (more while one item outgrows the buffer)
_WHITESPACE = " \t\n\r"


class JSONShapeError(ValueError):
    """A ``.json`` file that is not what its reader expected; the message names where, not the file."""


class _Text:
    """A UTF-8 file as text read ahead in chunks: ``buf[pos:]`` is what is not consumed yet."""

    def __init__(self, f, chunk: int):
        self.f, self.chunk, self.buf, self.pos, self.eof, self.read = f, chunk, "", 0, False, 0
        # utf-8-sig: a byte-order mark (Windows tools write one) starts the file, not its JSON
        self.utf8 = codecs.getincrementaldecoder("utf-8-sig")()

    def fill(self) -> bool:
        """Read more (at least as much as is buffered, so an item read again after each read costs
        its size a few times over, not its size squared); False at the end of the file."""
        if self.eof:
            return False
        if self.pos:
            self.buf, self.pos = self.buf[self.pos:], 0
        data = self.f.read(max(self.chunk, len(self.buf)))
        try:
            self.buf += self.utf8.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise JSONShapeError(f"is not UTF-8 ({e.reason} at byte {self.read + e.start:,})") from None
        self.read += len(data)
        self.eof = not data
        return True

    def peek(self) -> str | None:
        """The next character that is not whitespace (consuming the whitespace); None at the end."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return None


def top_level(path: Path) -> str | None:
    """The first character of ``path`` that is not whitespace: ``[`` for an array, ``{`` for
    JSON lines or one object; None for an empty file."""
    with open(path, "rb") as f:
        return _Text(f, 4096).peek()


def _truncated(e: json.JSONDecodeError, text: _Text) -> bool:
    """Whether decoding failed for want of the rest of the item (more of the file may complete it),
    rather than at a real error (said at once: not after reading the rest of a large file)."""
    return not text.eof and (e.msg.startswith("Unterminated string") or e.pos >= len(text.buf) - 16)


def array_items(path: Path, chunk: int = CHUNK) -> Iterator[tuple[int, object]]:
    """``(index, item)`` of the top-level array in ``path``, in order, one item decoded at a time;
    raises :class:`JSONShapeError` naming the item at fault."""
    decoder = json.JSONDecoder()
    with open(path, "rb") as f:
        text = _Text(f, chunk)
        if text.peek() != "[":
            raise JSONShapeError("does not start with '[' (its top level is not an array)")
        text.pos += 1
        index, first = 0, True
        while True:
            c = text.peek()
            if first and c == "]":
                text.pos += 1
                break
            if c is None:
                raise JSONShapeError(f"ends inside its top-level array, after item {index} (a file cut short?)")
            while True:
                try:
                    item, end = decoder.raw_decode(text.buf, text.pos)
                except json.JSONDecodeError as e:
                    if _truncated(e, text) and text.fill():
                        continue
                    if text.eof and (e.msg.startswith("Unterminated string") or e.pos >= len(text.buf.rstrip())):
                        raise JSONShapeError(f"ends inside item {index + 1} of its top-level array (a file cut "
                                             f"short?)") from None
                    raise JSONShapeError(f"item {index + 1} of its top-level array is not JSON ({e.msg})") from None
                # A number may go on in the next read: cut after its '.', 'e' or 'e-', its digits decode alone.
                if (end == len(text.buf) or (isinstance(item, (int, float)) and end + 2 >= len(text.buf))) \
                        and text.fill():
                    continue
                break
            text.pos = end
            yield index, item
            index, first = index + 1, False
            c = text.peek()
            if c == ",":
                text.pos += 1
            elif c == "]":
                text.pos += 1
                break
            else:
                raise JSONShapeError(f"item {index} of its top-level array is followed by "
                                     f"{'the end of the file' if c is None else repr(c)}, not ',' or ']'")
        if text.peek() is not None:
            raise JSONShapeError("holds more after its top-level array (two arrays, or an array then lines?)")
