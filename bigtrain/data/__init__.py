"""Token corpora (bytes, pre-tokenized ids, text through a tokenizer) and layout-independent sampling.

- :mod:`bigtrain.data.corpus`: the byte-level corpora and pre-tokenized files;
- :mod:`bigtrain.data.tokenizer`: ``data.tokenizer`` ('bytes', a tokenizer.json, a tiktoken file);
- :mod:`bigtrain.data.documents`: text files, JSON Lines and Parquet records as documents;
- :mod:`bigtrain.data.shards`: a corpus tokenized once into sharded memory-mapped id files;
- :mod:`bigtrain.data.load`: which of these a ``[data]`` section names, prepared and opened;
- :mod:`bigtrain.data.sampler`: the windows every layout draws the same way;
- :mod:`bigtrain.data.fields`: validation of the ``[data]`` fields against the model.
"""

from bigtrain.lazy_exports import lazy_getattr

# name -> the submodule that defines it, imported on first use: the sampler and the shards import
# torch (about 2 s of CPU), which validation (bigtrain.data.fields) and the commands that build
# nothing (presets, fields, config) do not need. bigtrain's own modules import from the submodules.
_EXPORTS = {
    **dict.fromkeys(["TEXT_SUFFIXES", "build_byte_corpus", "cache_path", "cache_root", "cached_corpus", "files_key",
                     "stdlib_files", "stdlib_key", "text_files", "token_dtype_problem"], "bigtrain.data.corpus"),
    **dict.fromkeys(["is_token_file", "load_corpus", "load_tokens", "prepare_corpus", "run_sampler", "uses_shards"],
                    "bigtrain.data.load"),
    **dict.fromkeys(["IGNORE_INDEX", "DataChanged", "TokenSampler"], "bigtrain.data.sampler"),
    "ShardedTokens": "bigtrain.data.shards",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
