from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.data import ByteTokenizer, TextSource, embedded_corpus, load_text


def test_byte_tokenizer_roundtrip() -> None:
    tok = ByteTokenizer()
    text = "The river flows north of the old town. Grüße!"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.vocab_size == 256
    assert tok.decode(ids) == text


def test_embedded_corpus_is_deterministic_and_sized() -> None:
    a = embedded_corpus(seed=3, size_bytes=50_000)
    assert a == embedded_corpus(seed=3, size_bytes=50_000)
    assert a != embedded_corpus(seed=4, size_bytes=50_000)
    assert len(a.encode("utf-8")) == 50_000
    words = set(a.lower().replace(".", " ").split())
    assert 150 <= len(words) <= 1000  # a real vocabulary, yet small enough to learn quickly
    # facts recur: the most common sentence appears many times, but the text is not one sentence repeated
    sentences = [s.strip() for s in a.split(".") if s.strip()]
    counts = {s: sentences.count(s) for s in set(sentences)}
    assert max(counts.values()) >= 5
    assert len(counts) > len(sentences) / 4


def test_microbatch_shapes_labels_and_determinism() -> None:
    src = TextSource(seq_len=32, seed=7)
    x, y = src.microbatch(2, 5, 6)
    assert x.shape == y.shape == (6, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one
    # each row is a contiguous window of the corpus: the last label continues it
    tokens = src.tokens
    for row_x, row_y in zip(x, y):
        window = torch.cat([row_x, row_y[-1:]])
        starts = (tokens.unfold(0, 33, 1) == window).all(dim=1).nonzero()
        assert len(starts) >= 1
    again = TextSource(seq_len=32, seed=7).microbatch(2, 5, 6)
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert not torch.equal(src.microbatch(2, 6, 6)[0], x)
    assert not torch.equal(src.microbatch(3, 5, 6)[0], x)
    assert not torch.equal(TextSource(seq_len=32, seed=8).microbatch(2, 5, 6)[0], x)


def test_text_and_path_sources(tmp_path: Path) -> None:
    text = "abcdefghij" * 3
    file = tmp_path / "corpus.txt"
    file.write_text(text, encoding="utf-8")
    assert load_text(str(file)) == text
    from_file = TextSource(path=str(file), seq_len=8, seed=0)
    from_text = TextSource(text=text, seq_len=8, seed=0)
    assert torch.equal(from_file.microbatch(0, 0, 4)[0], from_text.microbatch(0, 0, 4)[0])
    x, y = from_text.microbatch(0, 1, 3)
    assert ByteTokenizer().decode(x[0].tolist()) in text


def test_missing_and_short_files_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        TextSource(path=str(missing), seq_len=8, seed=0)
    short = tmp_path / "short.txt"
    short.write_text("abc", encoding="utf-8")
    with pytest.raises(ValueError, match=r"short\.txt.*3 tokens"):
        TextSource(path=str(short), seq_len=8, seed=0)
    with pytest.raises(ValueError, match="not both"):
        TextSource(text="x" * 20, path=str(short), seq_len=8, seed=0)


def test_a_tokenizer_file_tokenizes_the_text_and_sizes_the_models_vocabulary(tokenizer_file: Path) -> None:
    from tokenizers import Tokenizer

    from p2ptrain.config import RunConfig
    from p2ptrain.models import build_stage

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    text = embedded_corpus()[:20_000]
    source = TextSource(text=text, seq_len=32, seed=0, tokenizer=str(tokenizer_file))
    assert source.tokens.tolist() == tokenizer.encode(text, add_special_tokens=False).ids  # lines encode as one text
    ids, labels = source.microbatch(3, 1, 4)
    assert ids.shape == labels.shape == (4, 32) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    assert tokenizer.decode(ids[0].tolist()) in text  # a window is a piece of the text, packed across lines
    config = RunConfig(model="llama-tiny", tokenizer=str(tokenizer_file), seq_len=32)
    assert config.model_config.vocab_size == tokenizer.get_vocab_size() == 512
    model = build_stage(config.model_config, start=0, end=config.model_config.num_layers, seed=0)
    with torch.no_grad():
        loss = float(model(ids, labels)) / labels.numel()
    assert 5.5 < loss < 7.5  # about ln(512): untrained, over the tokenizer's vocabulary


def test_a_tokenizer_that_is_no_local_file_is_refused_saying_nothing_is_downloaded(tmp_path: Path) -> None:
    from p2ptrain.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="no such file or folder; give the path of a local tokenizer.json") as error:
        RunConfig(tokenizer="meta-llama/Llama-2-7b-hf")
    assert error.value.field == "tokenizer" and "nothing is downloaded" in str(error.value)
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": 1}')
    with pytest.raises(ConfigError, match="not a tokenizers file"):
        RunConfig(tokenizer=str(broken))


def test_a_folder_of_text_files_is_its_documents_in_path_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("second document " * 4, encoding="utf-8")
    (tmp_path / "a.txt").write_text("first document " * 4, encoding="utf-8")
    (tmp_path / "notes.md").write_text("not a text file of the corpus", encoding="utf-8")
    assert load_text(str(tmp_path)) == "first document " * 4 + "\n\n" + "second document " * 4
    source = TextSource(path=str(tmp_path), seq_len=16, seed=0)
    assert ByteTokenizer().decode(source.microbatch(0, 0, 1)[0][0].tolist()) in load_text(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .txt files"):
        load_text(str(tmp_path / "empty"))


def test_a_saved_datasets_folder_is_its_text_column(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = {"text": ["the first row of text", "", "the second row"], "label": [0, 1, 2]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "flat"))
    assert load_text(str(tmp_path / "flat")) == "the first row of text\n\nthe second row"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict({"text": ["held out"], "label": [3]})}
                         ).save_to_disk(str(tmp_path / "splits"))
    assert load_text(str(tmp_path / "splits")) == "the first row of text\n\nthe second row"
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "no-text"))
    with pytest.raises(ValueError, match=r"columns \['body'\]; p2ptrain trains on a column named text"):
        load_text(str(tmp_path / "no-text"))
    from p2ptrain.config import RunConfig

    assert RunConfig(data=str(tmp_path / "flat")).data == str(tmp_path / "flat")


def test_a_transformers_tokenizer_folder_tokenizes_like_its_tokenizer(tmp_path: Path, tokenizer_file: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from p2ptrain.config import RunConfig

    text = embedded_corpus()[:5_000]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    fast.save_pretrained(tmp_path / "fast")
    source = TextSource(text=text, seq_len=32, seed=0, tokenizer=str(tmp_path / "fast"))
    assert source.tokens.tolist() == TextSource(text=text, seq_len=32, seed=0, tokenizer=str(tokenizer_file)
                                                ).tokens.tolist()
    # a folder without tokenizer.json: a WordPiece vocabulary, read by AutoTokenizer
    words = sorted(set(text.lower().replace(".", " . ").replace(",", " , ").split()))
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    transformers.BertTokenizer(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path / "wordpiece")
    (tmp_path / "wordpiece" / "tokenizer.json").unlink(missing_ok=True)
    bert = transformers.AutoTokenizer.from_pretrained(tmp_path / "wordpiece")
    source = TextSource(text=text, seq_len=16, seed=0, tokenizer=str(tmp_path / "wordpiece"))
    assert source.tokens.tolist() == bert(text, add_special_tokens=False)["input_ids"]
    assert RunConfig(tokenizer=str(tmp_path / "wordpiece"), seq_len=16).model_config.vocab_size == len(bert)
