"""Tokenizers: ``data.tokenizer = "bytes" | PATH``.

- ``"bytes"``: a token is a byte of the UTF-8 text (vocabulary 256); no package needed.
- a Hugging Face ``tokenizer.json`` (or a folder holding one, such as a model folder), read with
  the ``tokenizers`` package (``pip install tokenizers``). Each document is encoded as the file's
  own post-processor frames it (Llama 3's adds ``<|begin_of_text|>``; GPT-2's adds nothing).
- a tiktoken encoding file (``NAME.tiktoken``: one base64 token and its rank a line), read with the
  ``tiktoken`` package; such a file carries no split pattern, so cl100k's (also Llama 3's) is used.

Document text is always ordinary text, for every kind: a document that quotes a special token
(``<|endoftext|>``, ``</s>``) is encoded as those characters, never as the special id (tiktoken's
``encode_ordinary``; ``encode_special_tokens`` for a tokenizer.json); the special ids a corpus
holds are those bigtrain puts there itself (the post-processor's frame, ``data.document_end``).

Local files only: nothing is downloaded. A tokenizer is identified by the SHA-256 of its file, so a
corpus tokenized with it is cached under that digest (:mod:`bigtrain.data.shards`), and
:func:`write_for_transformers` puts it beside an exported model for ``AutoTokenizer``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

BYTES = "bytes"
HF_FILE = "tokenizer.json"
# tiktoken's cl100k_base split pattern (Llama 3 uses the same); a .tiktoken file does not carry one.
CL100K_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names data.tokenizer and the fix."""


def tokenizer_file(spec: str) -> Path | None:
    """The file ``data.tokenizer`` names (a folder's tokenizer.json); None for 'bytes'."""
    if spec == BYTES:
        return None
    path = Path(os.path.expanduser(spec))
    return path / HF_FILE if path.is_dir() else path


def tokenizer_kind(spec: str) -> str:
    """'bytes', 'hf' (a tokenizer.json) or 'tiktoken' (any other file), from the name alone."""
    if spec == BYTES:
        return BYTES
    path = tokenizer_file(spec)
    return "hf" if path.suffix == ".json" else "tiktoken"


def missing_package(kind: str) -> str | None:
    """The pip command a tokenizer of ``kind`` needs, when its package is not importable."""
    import importlib.util

    package = {"hf": "tokenizers", "tiktoken": "tiktoken"}.get(kind)
    if package and importlib.util.find_spec(package) is None:
        return f"pip install {package}"
    return None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ByteTokenizer:
    kind, vocab_size, digest = BYTES, 256, BYTES

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def token_id(self, text: str) -> int | None:
        data = text.encode("utf-8")
        return data[0] if len(data) == 1 else None

    def frame_ids(self) -> tuple[list[int], list[int]]:
        return [], []  # a document is its bytes

    def special_id(self, names: tuple[str, ...]) -> int | None:
        return None  # 256 byte values, none special

    def prompt_ids(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` file."""

    kind = "hf"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path, self.digest = path, file_digest(path)
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust library raises its own exception type
            raise TokenizerError(f"data.tokenizer = '{path}' is not a tokenizers file ({e}); give a "
                                 f"tokenizer.json saved by the tokenizers or transformers library") from None
        # Each document whole, as the file's model and post-processor encode it: a truncation or
        # padding a pipeline saved in the file would cut every document to its max_length and fill the
        # short ones with pad ids.
        self._tok.no_truncation()
        self._tok.no_padding()
        # Document text is text: a page that quotes "<|endoftext|>" or "</s>" was encoded as that special
        # id (add_special_tokens=False stops only the post-processor's), ending a document where its
        # author only wrote characters, and letting a document inject control tokens. As tiktoken's
        # encode_ordinary, special tokens' text is encoded as ordinary pieces; the ids bigtrain puts
        # around documents itself (the post-processor's frame, data.document_end) are ids, not text.
        # (Ordinary added tokens, special=False, are vocabulary words and still match.)
        if not hasattr(self._tok, "encode_special_tokens"):
            raise TokenizerError(f"data.tokenizer = '{path}' needs tokenizers >= 0.15 (its encode_special_tokens "
                                 f"keeps special-token text in documents as text): pip install -U tokenizers")
        self._tok.encode_special_tokens = True
        # Its largest id + 1, not its count of tokens: a file may leave ids unused, and an id past the
        # count would pass the check against the model and wrap in the shards' narrower dtype.
        self.vocab_size = max([self._tok.get_vocab_size(with_added_tokens=True),
                               *(i + 1 for i in self._tok.get_vocab(with_added_tokens=True).values())])

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts)]

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def frame_ids(self) -> tuple[list[int], list[int]]:
        """The ids the file's post-processor puts before and after each document (Llama 3's
        ``<|begin_of_text|>`` before; none for GPT-2's): what every training document carried."""
        framed, plain = self._tok.encode("a").ids, self._tok.encode("a", add_special_tokens=False).ids
        for start in range(len(framed) - len(plain) + 1):
            if framed[start:start + len(plain)] == plain:
                return framed[:start], framed[start + len(plain):]
        return [], []

    def special_id(self, names: tuple[str, ...]) -> int | None:
        """The id of the first of ``names`` that is one of the file's special tokens."""
        special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return next((special[name] for name in names if name in special), None)

    def prompt_ids(self, text: str) -> list[int]:
        """``text`` as the start of a document: the post-processor's leading ids (Llama's BOS), as
        every training document began, then the text's ids, without the trailing ones (an end).
        Special-token text in it is ordinary text, as in every training document."""
        return self.frame_ids()[0] + self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class TiktokenTokenizer:
    """A tiktoken encoding file (mergeable ranks), split with cl100k's pattern."""

    kind = "tiktoken"

    def __init__(self, path: Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path, self.digest = path, file_digest(path)
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as e:  # noqa: BLE001 - base64 / format errors of a file that is not one
            raise TokenizerError(f"data.tokenizer = '{path}' is not a tiktoken encoding file ({e}); give a "
                                 f"tokenizer.json, a .tiktoken file or 'bytes'") from None
        if not ranks:  # (tiktoken.Encoding raised a bare "max() arg is an empty sequence" on it)
            raise TokenizerError(f"data.tokenizer = '{path}' is an empty tiktoken encoding file (no tokens in it); "
                                 f"give a .tiktoken file of 'BASE64 RANK' lines, a tokenizer.json or 'bytes'")
        self._enc = tiktoken.Encoding(path.stem, pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})
        self.vocab_size = self._enc.n_vocab

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self._enc.encode_ordinary_batch(texts, num_threads=1)]

    def token_id(self, text: str) -> int | None:  # an encoding file has no special tokens: one of its ranks
        ids = self._enc.encode_ordinary(text)
        return ids[0] if len(ids) == 1 else None

    def frame_ids(self) -> tuple[list[int], list[int]]:
        return [], []  # encode_ordinary: nothing around a document

    def special_id(self, names: tuple[str, ...]) -> int | None:
        return None  # an encoding file has no special tokens

    def prompt_ids(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def load_tokenizer(spec: str):
    """The tokenizer ``data.tokenizer`` names; raises TokenizerError naming the field and the fix."""
    kind = tokenizer_kind(spec)
    if kind == BYTES:
        return ByteTokenizer()
    path = tokenizer_file(spec)
    if not path.is_file():
        raise TokenizerError(f"data.tokenizer = '{spec}': {path} does not exist; give a tokenizer.json, a folder "
                             f"holding one, a .tiktoken file, or 'bytes'")
    need = missing_package(kind)
    if need:
        what = "a Hugging Face tokenizer.json" if kind == "hf" else "a tiktoken encoding file"
        raise TokenizerError(f"data.tokenizer = '{spec}' is {what}, which needs a package that is not installed: "
                             f"{need}")
    return HFTokenizer(path) if kind == "hf" else TiktokenTokenizer(path)


def document_end_id(tokenizer, text: str) -> int | None:
    """The id ``data.document_end`` names (None for ''); raises TokenizerError when it is not one
    token of ``tokenizer``."""
    if not text:
        return None
    found = tokenizer.token_id(text)
    if found is None:
        raise TokenizerError(f"data.document_end = {text!r} is not one token of data.tokenizer ({tokenizer.kind}); "
                             f"give a token the tokenizer has, such as its end-of-text token, or '' for none")
    return int(found)


# End-of-text tokens by their usual names: GPT-2's and Qwen's, Llama 3's, Llama 2's and Mistral's, Gemma's.
END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def bos_eos_ids(tokenizer, document_end: str = "") -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` of an exported model's config.json, those the tokenizer
    has (transformers' ``generate()`` stops at the eos; without one it never stops): the token the
    tokenizer puts before each document is the bos; the eos is the token it puts after each one,
    else ``data.document_end`` (the token the run put after each document), else a special token
    named as an end of text (:data:`END_OF_TEXT_NAMES`). Byte-level and tiktoken vocabularies have
    no special tokens: only ``data.document_end`` gives them an eos."""
    leading, trailing = tokenizer.frame_ids()
    out = {}
    if len(leading) == 1:
        out["bos_token_id"] = leading[0]
    if len(trailing) == 1:
        out["eos_token_id"] = trailing[0]
    elif document_end:
        out["eos_token_id"] = document_end_id(tokenizer, document_end)
    elif (end := tokenizer.special_id(END_OF_TEXT_NAMES)) is not None:
        out["eos_token_id"] = end
    return out


def ids_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id below ``vocab_size``."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# -- beside an exported model --------------------------------------------------------------------
def write_for_transformers(spec: str, out: Path, max_len: int, special: dict[str, int] | None = None) -> list[str]:
    """Write ``spec``'s tokenizer into the model folder ``out`` so that transformers'
    ``AutoTokenizer.from_pretrained(out)`` loads it (a ``tokenizer.json`` and a
    ``tokenizer_config.json`` naming the plain fast tokenizer: a model-specific class would add
    its own special tokens and encode otherwise than training did). ``special``: the
    ``bos_token_id`` / ``eos_token_id`` the export's config.json names (:func:`bos_eos_ids`), also
    named in ``tokenizer_config.json`` as ``bos_token`` / ``eos_token``: without them the loaded
    tokenizer's ``eos_token`` was None while the model's config named one, and what a user of
    transformers writes next (``tokenizer.pad_token = tokenizer.eos_token`` for a collator or a
    batched pipeline) failed. Returns the files written.

    transformers' fast tokenizer, called on text (``tokenizer(text)``), turns special-token text in
    it (``"<|endoftext|>"``) into the special id, where training encoded it as ordinary text
    (:class:`HFTokenizer`): pass ``split_special_tokens=True`` (to the call, or to
    ``from_pretrained``) to encode text as the run's documents were. That is left to the user, not
    written into ``tokenizer_config.json``: text that means its special tokens (a template's
    markers) would then lose them."""
    kind = tokenizer_kind(spec)
    if kind == BYTES:
        return []
    source = tokenizer_file(spec)
    if not source.is_file():
        raise TokenizerError(f"the run's data.tokenizer = '{spec}' no longer exists; the weights are exported, "
                             f"but without a tokenizer")
    target = Path(out) / HF_FILE
    if kind == "hf":
        shutil.copyfile(source, target)
    else:
        try:
            from transformers.convert_slow_tokenizer import TikTokenConverter
        except ImportError:
            raise TokenizerError("converting a tiktoken file to tokenizer.json needs transformers "
                                 "(pip install transformers)") from None
        TikTokenConverter(vocab_file=str(source), pattern=CL100K_PATTERN,
                          additional_special_tokens=[]).converted().save(str(target))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, **_special_token_names(target, special or {})}
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [HF_FILE, "tokenizer_config.json"]


def _special_token_names(tokenizer_json: Path, special: dict[str, int]) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` of a ``tokenizer_config.json``: the text of each id of
    ``special`` in ``tokenizer_json`` (the file AutoTokenizer loads), so that the names map back to
    the same ids. Only the file's special tokens are named: transformers registers a named token as
    special, and an ordinary one (a ``data.document_end`` such as a newline, or a tiktoken rank) would
    then be split out of text and encode otherwise than training did."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    specials = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return {key: specials[special[f"{key}_id"]] for key in ("bos_token", "eos_token")
            if special.get(f"{key}_id") in specials}
