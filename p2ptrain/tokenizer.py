"""Local Hugging Face tokenizers, torch-free (the recipe's checks read a tokenizer's size without loading torch).

Nothing is downloaded: a path that is no local file or folder is refused.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Encode = Callable[[list[str]], list[list[int]]]


def load_tokenizer(path: str) -> tuple[Encode, int]:
    """(encode a batch of texts without special tokens, the number of token ids) of a local tokenizer: a
    tokenizer.json file, a folder holding one, or a `transformers` tokenizer folder (read with AutoTokenizer,
    nothing downloaded). A ValueError says what the path is not."""
    where = Path(path)
    file = where / "tokenizer.json" if where.is_dir() else where
    if file.is_file():
        from tokenizers import Tokenizer

        try:
            fast = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception for any file it cannot parse
            raise ValueError(f"not a tokenizers file ({e})") from None
        return (lambda texts: [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)],
                fast.get_vocab_size(with_added_tokens=True))
    if not where.is_dir():
        raise FileNotFoundError("no such file or folder; give the path of a local tokenizer.json or of a "
                                "transformers tokenizer folder (nothing is downloaded from a hub)")
    from transformers import AutoTokenizer

    try:
        slow = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError or its own errors for a folder it cannot read
        raise ValueError(f"not a transformers tokenizer folder ({e})") from None
    return (lambda texts: slow(texts, add_special_tokens=False)["input_ids"], len(slow))
