"""Local Hugging Face tokenizers, torch-free (the recipe's checks read a tokenizer's size without loading torch).

Nothing is downloaded: a path that is no local file or folder is refused.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

Encode = Callable[[list[str]], list[list[int]]]


MASK_TOKENS = ("[MASK]", "<mask>")  # what BERT-style and RoBERTa-style tokenizers call their mask token


def load_tokenizer(path: str) -> tuple[Encode, int]:
    """(encode a batch of texts without special tokens, the number of token ids) of a local tokenizer: a
    tokenizer.json file, a folder holding one, or a `transformers` tokenizer folder (read with AutoTokenizer,
    nothing downloaded). A ValueError says what the path is not."""
    encode, size, _ = _load(path)
    return encode, size


def mask_token_id(path: str) -> int | None:
    """The id of a local tokenizer's mask token (`MASK_TOKENS`), which masked-LM batches need; None if it has
    none."""
    return _load(path)[2]


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple[Encode, int, int | None]:
    where = Path(path)
    file = where / "tokenizer.json" if where.is_dir() else where
    if file.is_file():
        from tokenizers import Tokenizer

        try:
            fast = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception for any file it cannot parse
            raise ValueError(f"not a tokenizers file ({e})") from None
        mask = next((i for i in map(fast.token_to_id, MASK_TOKENS) if i is not None), None)
        return (lambda texts: [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)],
                fast.get_vocab_size(with_added_tokens=True), mask)
    if not where.is_dir():
        raise FileNotFoundError("no such file or folder; give the path of a local tokenizer.json or of a "
                                "transformers tokenizer folder (nothing is downloaded from a hub)")
    from transformers import AutoTokenizer

    try:
        slow = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError or its own errors for a folder it cannot read
        raise ValueError(f"not a transformers tokenizer folder ({e})") from None
    return lambda texts: slow(texts, add_special_tokens=False)["input_ids"], len(slow), slow.mask_token_id
