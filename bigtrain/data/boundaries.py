"""The token ids that delimit a corpus's documents, for block-causal attention
(``model.attn_mask = "block_causal"``; the rule that reads them: :mod:`bigtrain.core.documents`).

What bigtrain itself puts around each document as it tokenizes (:mod:`bigtrain.data.shards`): the
tokenizer's frame (Llama 3's ``<|begin_of_text|>`` before, a ``$A </s>`` post-processor's end after)
and ``data.document_end`` after. A pre-tokenized ``.bin`` / ``.npy`` source was framed by whoever
made it, and the config cannot name its separator: none is known. Imports no torch (validation
reads it).
"""

from __future__ import annotations

from bigtrain.data.blend_spec import parse_blend
from bigtrain.data.tokenizer import BYTES, TokenizerError, document_end_id, load_tokenizer


TOKEN_FILE_SUFFIXES = (".bin", ".npy")  # as bigtrain.data.load reads a source (which imports torch)


def boundary_ids(d) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start ids, end ids) of ``d`` (the [data] section): the first id the tokenizer puts before
    each document begins one; the last id it puts after each one, and ``data.document_end``, end one.
    Raises TokenizerError (naming the fields and the fix) when there are none, or the tokenizer
    cannot be read."""
    sources = (d.source, d.val_source, *(p for p, _ in parse_blend(d.blend)))
    token_files = [s for s in sources if s and s.endswith(TOKEN_FILE_SUFFIXES)]
    if token_files:
        raise TokenizerError(f"model.attn_mask = 'block_causal' with the pre-tokenized corpus '{token_files[0]}': "
                             f"bigtrain does not know which of its ids separates documents; give the text (with "
                             f"data.document_end) or set model.attn_mask = 'causal'")
    tokenizer = load_tokenizer(d.tokenizer)
    leading, trailing = tokenizer.frame_ids()
    starts = tuple(leading[:1])
    ends = tuple(dict.fromkeys([*trailing[-1:], *filter(lambda i: i is not None,
                                                         [document_end_id(tokenizer, d.document_end)])]))
    if not starts and not ends:
        which = ("a byte corpus" if d.tokenizer == BYTES
                 else f"data.tokenizer = '{d.tokenizer}' puts no token around documents")
        raise TokenizerError(f"model.attn_mask = 'block_causal' needs a token that marks where documents meet, and "
                             f"{which} with data.document_end = '' has none; set data.document_end (e.g. "
                             f"'<|endoftext|>', or a byte such as '\\n' for bytes) or model.attn_mask = 'causal'")
    return starts, ends
