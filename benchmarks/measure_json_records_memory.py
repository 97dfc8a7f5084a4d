"""Peak resident memory of reading a large ``.json`` array of records (bigtrain.data.json_array),
against the same records as JSON Lines and against ``json.load`` of the whole array.

``python benchmarks/measure_json_records_memory.py [MEGABYTES]`` writes MEGABYTES x 1000 records of
1000 characters (default 200: a 259 MB array) to a temporary folder, then reads the text of every
record in a fresh process each (peak RSS from ``getrusage``, baseline: the import alone).
"""

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def read(mode: str, path: Path) -> None:
    start = time.perf_counter()
    if mode == "json.load":
        chars = sum(len(r["text"]) for r in json.load(open(path)))
    else:
        from bigtrain.data.documents import Documents

        chars = sum(len(t) for t in Documents([path], "text", json_records=mode == "array"))
    print(f"{mode:10s} {chars:,} characters, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB, "
          f"{time.perf_counter() - start:.1f} s", flush=True)


def main() -> None:
    megabytes = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    folder = Path(tempfile.mkdtemp(prefix="bench-json-"))
    array, lines = folder / "records.json", folder / "records.jsonl"
    record = {"text": ("Lorem ipsum dolor sit amet, ümlaut € " * 27)[:1000], "id": 0}
    with open(array, "w") as f, open(lines, "w") as g:
        f.write("[")
        for i in range(megabytes * 1000):
            record["id"] = i
            f.write(("," if i else "") + json.dumps(record))
            g.write(json.dumps(record) + "\n")
        f.write("]")
    print(f"array {array.stat().st_size / 1e6:.0f} MB")
    base = subprocess.run([sys.executable, "-c", "import resource, bigtrain.data.documents; "
                           "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"],
                          capture_output=True, text=True, check=True).stdout
    print(f"{'import':10s} peak RSS {float(base):.0f} MB")
    for mode, path in (("array", array), ("lines", lines), ("json.load", array)):
        subprocess.run([sys.executable, __file__, mode, str(path)], check=True)
    array.unlink()
    lines.unlink()
    folder.rmdir()


if __name__ == "__main__":
    if len(sys.argv) == 3:
        read(sys.argv[1], Path(sys.argv[2]))
    else:
        main()
