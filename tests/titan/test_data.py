"""The project's corpus and tokenizer: deterministic, small, loaded by TorchTitan's real path."""

import hashlib
import json
from pathlib import Path

import pytest

from torchtitan_ft.titan import training_data as data

# Changing the grammar changes this digest: bump data.CORPUS_VERSION (cache file name) and
# retrain the shipped tokenizer (python -m torchtitan_ft.titan.training_data --write-tokenizer).
TRAIN_CORPUS_SHA256 = "81b1c8fcf99b6dfc66209a16ca959b3fe19ab2eab351dce6017be336b99bb8fa"


def _digest(texts) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()


def test_corpus_is_deterministic_and_pinned() -> None:
    assert _digest(data.generate_corpus()) == TRAIN_CORPUS_SHA256
    assert list(data.generate_corpus(7, 5)) == list(data.generate_corpus(7, 5))
    assert list(data.generate_corpus(7, 5)) != list(data.generate_corpus(8, 5))


def test_validation_corpus_differs_from_training() -> None:
    train = set(data.generate_corpus(data.TRAIN_SEED, 50))
    validation = set(data.generate_corpus(data.VALIDATION_SEED, 50))
    assert not train & validation


def test_shipped_tokenizer_is_reproducible_and_fits_debugmodel(tmp_path: Path) -> None:
    data.train_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shipped = (data.TOKENIZER_DIR / name).read_bytes()
        assert (tmp_path / name).read_bytes() == shipped, f"{name} differs from a retrain"
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == data.VOCAB_SIZE <= 2048


def test_assets_are_small() -> None:
    total = sum(p.stat().st_size for p in data.ASSETS_DIR.rglob("*") if p.is_file())
    assert total < 2 * 1024 * 1024


def test_titan_tokenizer_adds_bos_and_eos() -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(str(data.TOKENIZER_DIR))
    ids = tokenizer.encode("The quorum commits the next step.", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.get_vocab_size() <= 2048
    assert tokenizer.decode(ids[1:-1]) == "The quorum commits the next step."


@pytest.fixture
def restore_datasets():
    """Undo registrations made with a temporary cache directory."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    saved = dict(DATASETS)
    yield
    DATASETS.clear()
    DATASETS.update(saved)


@pytest.mark.usefixtures("restore_datasets")
def test_registered_dataset_loads_through_titan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    data.register_datasets()
    assert DATASETS[data.TRAIN_DATASET].path == str(data.corpus_path())
    tokenizer = HuggingFaceTokenizer(str(data.TOKENIZER_DIR))

    def first_inputs(dp_rank: int) -> list[int]:
        dataset = HuggingFaceTextDataset(
            data.VALIDATION_DATASET, None, tokenizer, seq_len=32, dp_rank=dp_rank, dp_world_size=2
        )
        sample, label = next(iter(dataset))
        assert sample["input"].shape == label.shape == (32,)
        return sample["input"].tolist()

    first, second = first_inputs(0), first_inputs(1)
    assert first[0] == tokenizer.bos_id
    assert first != second  # dp ranks read different slices
    assert data.corpus_path(data.VALIDATION_DATASET).exists()  # generated on first use
