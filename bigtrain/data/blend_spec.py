"""``data.blend``: the text of a blend of corpora, read and checked (imports no torch: validation reads it).

``'PATH=SHARE, PATH=SHARE'``: corpora trained on besides ``data.source``, each with its share of the
training windows; ``data.source`` takes the rest (1 minus their sum).
"""

from __future__ import annotations

import math


def parse_blend(text: str) -> list[tuple[str, float]]:
    """[(path, share)] of a ``data.blend`` text ('' -> []); ValueError naming the entry it cannot read."""
    entries = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        path, sep, share = entry.rpartition("=")
        try:
            value = float(share)
        except ValueError:  # float's own message names the share only, not the entry it stands in
            raise ValueError(entry) from None
        if not sep or not path.strip():
            raise ValueError(entry)
        entries.append((path.strip(), value))
    return entries


def blend_problems(text: str) -> list[str]:
    """What is wrong with ``data.blend`` as text: entries, shares (each in (0, 1), together below 1:
    data.source keeps the rest), a corpus named twice."""
    if not text.strip():
        return []
    example = "e.g. 'code.jsonl=0.3, math.txt=0.1' (data.source takes the remaining 0.6)"
    try:
        entries = parse_blend(text)
    except ValueError as e:
        return [f"data.blend: cannot read {str(e)!r}: give corpora and their shares of the training windows as "
                f"'PATH=SHARE, PATH=SHARE', {example}"]
    problems = [f"data.blend: {path} = {share:g}: a share must be in (0, 1), {example}"
                for path, share in entries if not (math.isfinite(share) and 0 < share < 1)]
    total = sum(share for _, share in entries)
    if not problems and total >= 1:
        problems.append(f"data.blend: the shares add up to {total:g}, leaving data.source none; they must add up "
                        f"to less than 1, {example}")
    paths = [path for path, _ in entries]
    problems += [f"data.blend names {path} twice; give each corpus once, with its whole share"
                 for path in sorted({p for p in paths if paths.count(p) > 1})]
    return problems


def source_share(entries: list[tuple[str, float]]) -> float:
    """data.source's share: what the blend leaves."""
    return 1.0 - sum(share for _, share in entries)
