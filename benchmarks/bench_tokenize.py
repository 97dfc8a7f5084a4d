"""Tokenizing a corpus into shards (bigtrain.data.shards) against the tokenizer's own encode_batch.

``python benchmarks/bench_tokenize.py [MEGABYTES]``: trains a 4096-id byte-level BPE on 60 standard
library modules (no download), then tokenizes the standard library's first MEGABYTES (default 8)
with 1 and 2 worker processes, and times opening the cached corpus (its key from file digests
remembered by path, size and mtime) and verifying its checksums.
"""

import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bigtrain.config import DataConfig
from bigtrain.data import load_corpus, prepare_corpus


def main() -> None:
    megabytes = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    root = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [p.read_text(errors="replace") for p in files[:60]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    size = sum(len(t.encode()) for t in texts)
    start = time.perf_counter()
    tok.encode_batch(texts)
    print(f"tokenizers encode_batch, in process: {size / 1e6 / (time.perf_counter() - start):.2f} MB/s")
    for workers in (1, 2):
        d = DataConfig(source="stdlib", tokenizer=str(root / "tokenizer.json"), cache_dir=str(root / f"c{workers}"),
                       max_bytes=int(megabytes * 1e6))
        start = time.perf_counter()
        manifest = prepare_corpus(d, shard_bytes=1 << 20, workers=workers)
        took = time.perf_counter() - start
        print(f"workers={workers}: {manifest['tokens']:,} tokens from {megabytes:g} MB in {took:.1f} s "
              f"({megabytes / took:.2f} MB/s, {len(manifest['shards'])} shards)")
        start = time.perf_counter()
        load_corpus(d)
        opened = time.perf_counter() - start
        start = time.perf_counter()
        prepare_corpus(d, check=True)
        print(f"  cached: opened in {opened:.2f} s, checksums verified in {time.perf_counter() - start:.2f} s")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
