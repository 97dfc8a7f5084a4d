"""Token corpora (bytes, pre-tokenized ids, text through a tokenizer) and layout-independent sampling.

- :mod:`bigtrain.data.corpus`: the byte-level corpora and pre-tokenized files;
- :mod:`bigtrain.data.tokenizer`: ``data.tokenizer`` ('bytes', a tokenizer.json, a tiktoken file);
- :mod:`bigtrain.data.documents`: text files, JSON Lines and Parquet records as documents;
- :mod:`bigtrain.data.shards`: a corpus tokenized once into sharded memory-mapped id files;
- :mod:`bigtrain.data.load`: which of these a ``[data]`` section names, prepared and opened;
- :mod:`bigtrain.data.sampler`: the windows every layout draws the same way;
- :mod:`bigtrain.data.fields`: validation of the ``[data]`` fields against the model.
"""

from bigtrain.data.corpus import (TEXT_SUFFIXES, build_byte_corpus, cache_path, cache_root, cached_corpus,
                                  files_key, stdlib_files, stdlib_key, text_files, token_dtype_problem)
from bigtrain.data.load import is_token_file, load_corpus, load_tokens, prepare_corpus, run_sampler, uses_shards
from bigtrain.data.sampler import IGNORE_INDEX, DataChanged, TokenSampler
from bigtrain.data.shards import ShardedTokens

__all__ = ["TEXT_SUFFIXES", "IGNORE_INDEX", "DataChanged", "ShardedTokens", "TokenSampler", "build_byte_corpus", "cache_path",
           "cache_root", "cached_corpus", "files_key", "load_corpus", "load_tokens", "prepare_corpus", "run_sampler",
           "stdlib_files", "stdlib_key", "text_files", "token_dtype_problem", "uses_shards", "is_token_file"]
