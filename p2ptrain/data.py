"""Training text and its tokens: byte-level, or a Hugging Face tokenizer's.

With no `--data PATH`, runs train on `embedded_corpus()`: English-like text the project generates itself
from a small world of places, people and things, so nothing is downloaded. The text repeats a fixed set of
facts in varied sentences and fills in grammatical sentences around them, which gives a byte-level model
plenty to learn quickly (spelling, word order, the facts) while staying far from trivial.

`TextSource.microbatch(epoch, index, rows)` depends only on (seed, epoch, index, rows): every process that
asks for the same batch gets the same tokens, which the runtime relies on (the stage-0 FS and the
single-process reference read the same rows).

`--data PATH` is a UTF-8 text file, a folder of them (every `*.txt` under it, in path order), or a Hugging Face
`datasets` folder written by `save_to_disk` (its `text` column; of a DatasetDict, the `train` split). Each file or
row is a document.

Tokens are UTF-8 bytes (`ByteTokenizer`) unless the recipe names a tokenizer (`--tokenizer PATH`: a local
`tokenizer.json` read with Hugging Face's `tokenizers`, or a local `transformers` tokenizer folder). Either way the
whole text becomes one stream of tokens, documents one after the other (a blank line between two), and every row is
a window of `seq_len + 1` tokens of it: documents are packed into rows, and a row may span the end of one and the
start of the next, as GPT-style pretraining packs them. A masked-LM model (ALBERT) trains on the same windows,
corrupted as BERT corrupts them (`Masking`).
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from p2ptrain.tokenizer import load_tokenizer, mask_token_id

if TYPE_CHECKING:
    from p2ptrain.config import RunConfig


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, no unknowns, no merges."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # a window may cut a multi-byte character; replace it rather than fail
        return bytes(ids).decode("utf-8", errors="replace")


DOCUMENT_BREAK = "\n\n"


def load_text(path: str) -> str:
    """The documents of `path` (a text file, a folder of them, or a saved `datasets` folder) as one text; a
    ValueError names the path the user gave and what is wrong with it."""
    return DOCUMENT_BREAK.join(load_documents(path))


def load_documents(path: str) -> list[str]:
    where = Path(path)
    if where.is_file():
        return [where.read_text(encoding="utf-8", errors="replace")]
    if not where.is_dir():
        raise FileNotFoundError(f"data {path!r} does not exist; give a text file, a folder of .txt files or a "
                                "datasets folder (save_to_disk)")
    if (where / "dataset_dict.json").is_file() or (where / "state.json").is_file():
        return _dataset_documents(where)
    files = sorted(file for file in where.rglob("*.txt") if file.is_file())
    if not files:
        raise ValueError(f"data folder {path!r} holds no .txt files and is no datasets folder (save_to_disk)")
    return [file.read_text(encoding="utf-8", errors="replace") for file in files]


def _dataset_documents(folder: Path) -> list[str]:
    """The `text` column of a dataset saved with `save_to_disk` (of a DatasetDict, its `train` split)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data {str(folder)!r} is a datasets folder; reading it needs the datasets package "
                         "(pip install datasets)") from None
    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"datasets folder {str(folder)!r} has splits {sorted(loaded)}, none named train")
        loaded = loaded["train"]
    if "text" not in loaded.column_names:
        raise ValueError(f"datasets folder {str(folder)!r} has columns {loaded.column_names}; p2ptrain trains on a "
                         "column named text")
    return [text for text in loaded["text"] if text]


@dataclass(frozen=True, kw_only=True)
class Masking:
    """BERT's masked-LM corruption of a row: `count(seq_len)` positions drawn at random, of which 80% become the
    mask token, 10% a random token and 10% stay; the labels are the original ids there and -100 elsewhere. Every row
    has the same count of masked positions, so the loss per token of a batch, as the swarm averages it, is a fixed
    multiple of the mean loss of a masked token (which `models.albert` reports)."""

    mask_id: int
    vocab: int  # a random replacement draws from ids [0, vocab)
    rate: float = 0.15

    @classmethod
    def of(cls, config: RunConfig) -> Masking | None:
        """The run's masking: none for a causal model; byte-level tokens take id 256 for the mask."""
        if config.model_config.causal:
            return None
        if config.tokenizer is None:
            return cls(mask_id=ByteTokenizer.vocab_size, vocab=ByteTokenizer.vocab_size)
        return cls(mask_id=mask_token_id(config.tokenizer), vocab=load_tokenizer(config.tokenizer)[1])

    def count(self, seq_len: int) -> int:
        return max(1, round(self.rate * seq_len))

    def apply(self, ids: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(corrupted ids, labels) of int64 rows `ids`, drawn from `rng`."""
        rows, seq_len = ids.shape
        chosen = torch.from_numpy(rng.random((rows, seq_len)).argsort(axis=1)[:, :self.count(seq_len)])
        kind = torch.from_numpy(rng.random(chosen.shape))
        random_ids = torch.from_numpy(rng.integers(0, self.vocab, size=chosen.shape))
        original = ids.gather(1, chosen)
        replaced = torch.where(kind < 0.8, torch.full_like(original, self.mask_id),
                               torch.where(kind < 0.9, random_ids, original))
        labels = torch.full_like(ids, -100).scatter(1, chosen, original)
        return ids.scatter(1, chosen, replaced), labels


class TextSource:
    """Fixed-length training windows drawn deterministically from one text: next-token pairs, or masked-LM ones
    (`masking`)."""

    def __init__(self, *, text: str | None = None, path: str | None = None, seq_len: int, seed: int,
                 tokenizer: str | None = None, masking: Masking | None = None):
        if text is not None and path is not None:
            raise ValueError("give text or path, not both")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if path is not None:
            origin, text = f"data {path!r}", load_text(path)
        elif text is not None:
            origin = "the given text"
        else:
            origin, text = "the embedded corpus", embedded_corpus()
        if tokenizer is None:  # ByteTokenizer's ids, kept as bytes: a large file stays 1 byte per token
            self.tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        else:
            self.tokens = tokenize(text, tokenizer)
        if len(self.tokens) < seq_len + 1:
            raise ValueError(f"{origin} has {len(self.tokens)} tokens, too short for one sequence of {seq_len} + 1")
        self.seq_len = seq_len
        self.seed = seed
        self.origin = origin
        self.masking = masking

    def microbatch(self, epoch: int, index: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), both int64 [rows, seq_len]; labels[:, t] is the token after input_ids[:, t], or with
        masking the original token where input_ids[:, t] was corrupted and -100 elsewhere."""
        if min(epoch, index) < 0 or rows < 1:
            raise ValueError(f"need epoch >= 0, index >= 0, rows >= 1; got {epoch}, {index}, {rows}")
        # numpy seeds from the whole (seed, epoch, index) tuple, so neighbouring batches are unrelated
        rng = np.random.default_rng([self.seed, epoch, index])
        starts = torch.from_numpy(rng.integers(0, len(self.tokens) - self.seq_len, size=rows))
        windows = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        if self.masking is not None:
            return self.masking.apply(windows[:, :-1].contiguous(), rng)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def held_out(self, *, rows: int, per_call: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed held-out set: the first `rows` windows this source draws, in (input_ids, labels) pieces of at most
        `per_call` rows; the same for everyone who builds it from the same text, length and seed."""
        sizes = [min(per_call, rows - start) for start in range(0, rows, per_call)]
        return [self.microbatch(0, index, size) for index, size in enumerate(sizes)]


def tokenize(text: str, tokenizer: str) -> torch.Tensor:
    """The token ids of `text` under a local tokenizer (`load_tokenizer`), as one int32 stream. The text is encoded
    line by line, each line with its newline (the tokenizer's own splitting sees the same pieces, and the lines
    encode in parallel), with no special tokens added."""
    try:
        encoder, vocab = load_tokenizer(tokenizer)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {tokenizer!r}: {e}") from None
    lines = [line for line in re.split(r"(?<=\n)", text) if line]
    ids = encoder(lines)
    tokens = torch.tensor([token for line in ids for token in line], dtype=torch.int32)
    if len(tokens) and int(tokens.max()) >= vocab:  # a file whose ids have gaps: the model's embedding is `vocab` wide
        raise ValueError(f"tokenizer {tokenizer!r} gives id {int(tokens.max())}, past its {vocab} tokens")
    return tokens


# The generated world. Words are plain English; the mix of fixed facts and free sentences is what matters.
_NAMES = (
    "Anna", "Boris", "Clara", "David", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas", "Karin", "Leo",
    "Maria", "Nico", "Olga", "Paul", "Rosa", "Simon", "Tara", "Victor", "Wanda", "Yuri", "Zoe", "Omar",
)
_PLACES = (
    "town", "village", "harbor", "market", "mill", "bridge", "castle", "forest", "valley", "farm", "school",
    "library", "church", "station", "garden", "tower", "lake", "hill", "bakery", "inn", "square", "port",
)
_PLACE_ADJS = ("old", "new", "small", "quiet", "busy", "green", "stone", "white", "high", "low", "far", "near")
_DIRECTIONS = ("north", "south", "east", "west")
_JOBS = (
    "baker", "farmer", "teacher", "doctor", "sailor", "miller", "smith", "painter", "writer", "guard", "cook",
    "weaver", "carpenter", "fisher", "singer", "builder", "tailor", "potter", "merchant", "gardener", "nurse",
    "shepherd", "judge", "priest",
)
_THINGS = (
    "apples", "bread", "books", "boats", "bells", "candles", "cheese", "coats", "fish", "flowers", "horses",
    "lamps", "letters", "maps", "nets", "pots", "rope", "salt", "sheep", "stones", "tools", "wine", "wool",
    "baskets", "blankets", "boots", "buttons", "cakes", "chairs", "clocks", "cups", "eggs", "hats", "keys",
    "knives", "nails", "pears", "plums", "shoes", "spoons", "tables", "onions", "honey", "milk", "beans",
)
_COLORS = ("red", "blue", "green", "yellow", "black", "white", "brown", "gray")
_ANIMALS = (
    "dog", "cat", "horse", "goat", "bird", "fox", "owl", "cow", "duck", "mouse", "rabbit", "pig", "hen",
    "donkey", "frog", "bear",
)
_ADJS = (
    "little", "big", "tired", "happy", "quiet", "loud", "young", "clever", "kind", "slow", "quick", "brave",
    "hungry", "careful", "lazy", "proud", "gentle", "curious", "sleepy", "angry", "calm", "friendly", "shy",
    "wild", "fat", "thin", "strong", "silly", "polite", "honest",
)
_INTRANSITIVE = (
    "sleeps", "sings", "waits", "runs", "walks", "rests", "works", "laughs", "reads", "plays", "dances",
    "cries", "jumps", "swims", "sits", "listens", "dreams", "hides", "shouts", "smiles",
)
_TRANSITIVE = (
    "sees", "finds", "helps", "follows", "watches", "meets", "calls", "visits", "greets", "thanks", "teaches",
    "warns", "pays", "trusts", "answers", "invites", "remembers", "forgets",
)
_CARRY = (
    "sells", "buys", "carries", "makes", "keeps", "brings", "counts", "mends", "paints", "wants", "orders",
    "packs", "hides", "gives away", "washes", "loads",
)
_TIMES = (
    "in the morning", "at noon", "in the evening", "at night", "every day", "on Monday", "on Tuesday",
    "on Friday", "on Sunday", "after the rain", "before dinner", "after lunch", "in the spring",
    "in the summer", "in the autumn", "in the winter", "once a week", "twice a month", "at dawn", "at dusk",
)
_WEATHER = ("rain", "snow", "wind", "fog", "a storm", "thunder", "hail", "a rainbow")
_CONNECT = ("and then", "but", "so", "because", "while")


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


class _World:
    """A fixed set of facts (who lives where, does what, likes which color; where places lie)."""

    def __init__(self, rng: random.Random):
        self.place_name = {p: f"the {rng.choice(_PLACE_ADJS)} {p}" for p in _PLACES}
        self.place_dir = {p: (rng.choice(_DIRECTIONS), rng.choice(_PLACES)) for p in _PLACES}
        self.home = {n: rng.choice(_PLACES) for n in _NAMES}
        self.job = {n: rng.choice(_JOBS) for n in _NAMES}
        self.color = {n: rng.choice(_COLORS) for n in _NAMES}
        self.pet = {n: rng.choice(_ANIMALS) for n in _NAMES}
        self.trade = {j: rng.sample(_THINGS, 2) for j in _JOBS}

    def fact(self, rng: random.Random) -> str:
        n = rng.choice(_NAMES)
        p = rng.choice(_PLACES)
        kind = rng.randrange(7)
        if kind == 0:
            return f"{n} lives in {self.place_name[self.home[n]]}."
        if kind == 1:
            return f"{n} is {_a(self.job[n])}."
        if kind == 2:
            return f"the favorite color of {n} is {self.color[n]}."
        if kind == 3:
            return f"{n} has {_a(self.pet[n])}."
        if kind == 4:
            d, q = self.place_dir[p]
            return f"{self.place_name[p]} lies {d} of {self.place_name[q]}."
        if kind == 5:
            j = self.job[n]
            return f"{n} the {j} {rng.choice(_CARRY)} {rng.choice(self.trade[j])} at {self.place_name[self.home[n]]}."
        return f"the {self.pet[n]} of {n} {rng.choice(_INTRANSITIVE)} near {self.place_name[self.home[n]]}."

    def sentence(self, rng: random.Random) -> str:
        n, m = rng.sample(_NAMES, 2)
        kind = rng.randrange(6)
        if kind == 0:
            return f"the {rng.choice(_ADJS)} {rng.choice(_ANIMALS)} {rng.choice(_INTRANSITIVE)} {rng.choice(_TIMES)}."
        if kind == 1:
            return f"{n} {rng.choice(_TRANSITIVE)} {m} at {self.place_name[rng.choice(_PLACES)]} {rng.choice(_TIMES)}."
        if kind == 2:
            return f"{n} {rng.choice(_CARRY)} {rng.randint(2, 12)} {rng.choice(_THINGS)} for {m}."
        if kind == 3:
            return f"there is {rng.choice(_WEATHER)} over {self.place_name[rng.choice(_PLACES)]} {rng.choice(_TIMES)}."
        if kind == 4:
            first = f"{n} {rng.choice(_INTRANSITIVE)}"
            second = f"{m} {rng.choice(_TRANSITIVE)} the {rng.choice(_ADJS)} {rng.choice(_ANIMALS)}"
            return f"{first} {rng.choice(_CONNECT)} {second}."
        return f"{n} asks {m} where {self.place_name[rng.choice(_PLACES)]} is."


def embedded_corpus(*, seed: int = 0, size_bytes: int = 400_000) -> str:
    """Deterministic generated English of about `size_bytes` bytes (ASCII, so bytes == characters)."""
    rng = random.Random(seed)
    world = _World(rng)
    paragraphs: list[str] = []
    total = 0
    while total < size_bytes:
        # about half of all sentences state a fact of the world, so the facts recur many times
        sentences = [world.fact(rng) if rng.random() < 0.5 else world.sentence(rng) for _ in range(rng.randint(3, 7))]
        paragraph = " ".join(s[0].upper() + s[1:] for s in sentences)
        paragraphs.append(paragraph)
        total += len(paragraph) + 1
    return "\n".join(paragraphs)[:size_bytes]
