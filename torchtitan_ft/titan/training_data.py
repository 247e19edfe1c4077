"""What a replica group reads, in every trainer rank: the project's corpus and tokenizer
registered with TorchTitan's data path, and the ledger of batches consumed by committed steps
(docs/titan.md, "The corpus and tokenizer" and "Data")."""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRAIN_DATASET = "ft_corpus"
"""Name of the training corpus in TorchTitan's ``DATASETS``."""
VALIDATION_DATASET = "ft_corpus_validation"
"""Name of the held-out corpus (same grammar, another seed) in TorchTitan's ``DATASETS``."""

CORPUS_VERSION = 1
"""Bump when the grammar changes: the cache file name carries it."""
TRAIN_SEED, VALIDATION_SEED = 20260101, 20260202
TRAIN_DOCUMENTS, VALIDATION_DOCUMENTS = 3000, 200

VOCAB_SIZE = 2000
"""BPE vocabulary size including the special tokens (llama3 debugmodel has 2048 rows)."""
BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|end_of_text|>"

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
"""Directory to pass as ``model.hf_assets_path``."""

CACHE_ENV = "TORCHTITAN_FT_CACHE_DIR"

# --- the grammar -----------------------------------------------------------------------------

_SUBJECTS = [
    "the lighthouse",
    "the manager",
    "each replica group",
    "a healthy replica",
    "the recovering replica",
    "the trainer",
    "the optimizer",
    "the process group",
    "the quorum",
    "every rank",
    "the checkpoint transport",
    "the data loader",
    "the scheduler",
    "a new worker",
    "the operator",
    "the cluster",
    "the model",
    "the gradient",
]
_VERBS = [
    "waits for",
    "sends",
    "receives",
    "checks",
    "commits",
    "discards",
    "reports",
    "repairs",
    "restarts",
    "computes",
    "averages",
    "writes",
    "loads",
    "streams",
    "measures",
    "records",
    "heals",
    "joins",
]
_OBJECTS = [
    "the next step",
    "a fresh quorum",
    "the gradients",
    "the latest weights",
    "its optimizer state",
    "a heartbeat",
    "the commit vote",
    "the training loss",
    "a failed collective",
    "the checkpoint",
    "the learning rate",
    "a batch of tokens",
    "the shard of parameters",
    "the error",
    "the step counter",
    "the store address",
    "the participants",
    "the timeout",
]
_ADVERBS = [
    "quickly",
    "carefully",
    "again",
    "at once",
    "in the background",
    "before the forward pass",
    "after the backward pass",
    "over the network",
    "without a restart",
    "every few seconds",
    "when a peer fails",
    "only on success",
]
_CONNECTIVES = ["Then", "Meanwhile", "After that", "Because of this", "Later", "Finally", "So"]
_NAMES = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Leslie", "Ken", "Radia", "John"]
_FACTS = [
    "A step is committed only when every participant votes yes.",
    "If a replica dies, the others keep training with a smaller quorum.",
    "A replica that falls behind copies the weights from a healthy peer.",
    "The loss goes down slowly when the learning rate is too small.",
    "Errors are data: a failed step is discarded, not fatal.",
    "The lighthouse decides which replica groups form the quorum.",
    "Gradients are averaged over the replicas that take part in the step.",
    "Each replica group reads its own slice of the data.",
]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.15:
        return rng.choice(_FACTS)
    subject, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
    if kind < 0.35:
        step, replicas = rng.randint(1, 999), rng.randint(2, 16)
        return f"At step {step}, {subject} {verb} {obj} from {replicas} replicas."
    if kind < 0.45:
        who = rng.choice(_NAMES)
        return f"{who} said that {subject} {verb} {obj} {rng.choice(_ADVERBS)}."
    text = f"{subject} {verb} {obj} {rng.choice(_ADVERBS)}"
    if rng.random() < 0.3:
        text = f"{rng.choice(_CONNECTIVES)} {text}"
    return text[0].upper() + text[1:] + "."


def _document(rng: random.Random, index: int) -> str:
    title = f"Note {index}: {rng.choice(_SUBJECTS)} and {rng.choice(_OBJECTS)}."
    paragraphs = [
        " ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(rng.randint(1, 3))
    ]
    return "\n\n".join([title, *paragraphs])


def generate_corpus(seed: int = TRAIN_SEED, documents: int = TRAIN_DOCUMENTS) -> Iterator[str]:
    """Yield ``documents`` texts, deterministic for a given ``seed``."""
    rng = random.Random(seed)
    for index in range(documents):
        yield _document(rng, index)


# --- files ------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$TORCHTITAN_FT_CACHE_DIR``, else ``~/.cache/torchtitan_ft``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "torchtitan_ft")


def corpus_path(name: str = TRAIN_DATASET) -> Path:
    """Default JSON-lines file of the named corpus in the cache directory."""
    return cache_dir() / f"{name}-v{CORPUS_VERSION}.jsonl"


def write_corpus(path: Path, seed: int, documents: int) -> Path:
    """Write the corpus as JSON lines atomically (concurrent ranks may race; same bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for text in generate_corpus(seed, documents):
            f.write(json.dumps({"text": text}) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def ensure_corpus(name: str = TRAIN_DATASET) -> Path:
    """Path of the named corpus in the cache, generating it first if missing."""
    seed, documents = _CORPORA[name]
    path = corpus_path(name)
    if not path.exists():
        write_corpus(path, seed, documents)
    return path


_CORPORA = {
    TRAIN_DATASET: (TRAIN_SEED, TRAIN_DOCUMENTS),
    VALIDATION_DATASET: (VALIDATION_SEED, VALIDATION_DOCUMENTS),
}


# --- tokenizer --------------------------------------------------------------------------------


def train_tokenizer(output_dir: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train the ByteLevel BPE on the training corpus and save it for ``HuggingFaceTokenizer``.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (BOS/EOS names) into
    ``output_dir`` and returns it. Deterministic: the corpus is, and BPE merges are chosen by
    count with a fixed tie-break.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # heavy, rare

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(), trainer=trainer)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output_dir / "tokenizer.json"))
    config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": True,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (output_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return output_dir


# --- TorchTitan registration ------------------------------------------------------------------


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def _loader_for(name: str):
    def load(path: str):
        from datasets import load_dataset  # heavy: only where the corpus is read

        if path == str(corpus_path(name)):
            ensure_corpus(name)
        return load_dataset("json", data_files=path, split="train")

    load.__name__ = f"load_{name}"
    return load


def register_datasets() -> None:
    """Add the project's corpora to TorchTitan's ``DATASETS`` (idempotent).

    ``training.dataset_path`` still overrides the path, as for any TorchTitan dataset; the
    default path is generated on first use.
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # load order: run_module imports this module before the CPU fixes and TorchTitan
    from torchtitan.hf_datasets import text_datasets

    for name in _CORPORA:
        text_datasets.DATASETS[name] = text_datasets.DatasetConfig(
            path=str(corpus_path(name)), loader=_loader_for(name), sample_processor=_text
        )


# --- the replica group's data position -------------------------------------------------------


class CommittedBatches:
    """A replica group's batches, consumed only by committed steps in which it participated.

    TorchTitan's loop reads a step's batches before anyone knows whether the step commits. This
    iterator (``Trainer.batch_generator`` reads through it) hands out batches of this group's
    slice and keeps the step's batches until :meth:`end_step` says what happened to them:

    * committed and this group participated: the batches are *consumed*;
    * otherwise (the step was discarded, or this group was healing / a spare and contributed
      zeros): the batches are *retried*, handed out again, first, by the next step.

    So every batch of the slice lands in exactly one committed gradient, in slice order.

    With ``skip_left_out`` (``fault_tolerance.numerics = "torchtitan_ft_trainer"``) a group left
    out of a step that committed (healing, or a spare) drops that step's batches instead, as
    TorchTitan's FT trainer does: they are *skipped by request*. The group reports the count in
    its next participating step (:meth:`skips_to_report`), and every group then adds it to
    ``consumed`` and ``skipped`` (:meth:`end_step`), so the ledger accounts for every batch of
    the slice as trained once or skipped once. A group that dies before reporting has its
    skipped batches trained after its restart instead (the ledger never counted them).

    ``consumed[g]`` counts the batches of replica group ``g``'s slice consumed so far, for
    every group (each group learns the step's participants from a participation all-reduce,
    see ``ManagedReplicaAxis``). The ledger travels with the healed state
    (:meth:`state_dict`): a restarted group receives it with the weights, whose gradients
    contain exactly those batches, and moves its own reader to ``consumed[replica_id]``
    (reading forward; the dataloader cannot seek). Nothing of its slice is replayed or skipped.

    Args:
        dataloader: this group's (TorchTitan, stateful) dataloader over its slice.
        replica_id: this replica group's index.
        group_size: the planned number of replica groups.
        skip_left_out: drop, not retry, the batches of a committed step this group was left
            out of (see above). Default False.
    """

    def __init__(
        self, dataloader: Any, replica_id: int, group_size: int, skip_left_out: bool = False
    ) -> None:
        self.dataloader = dataloader
        self.replica_id = replica_id
        self.skip_left_out = skip_left_out
        self.consumed = [0] * group_size
        self.skipped = [0] * group_size
        """Of ``consumed[g]``, the batches group ``g`` skipped by request (``skip_left_out``)."""
        self._unreported = 0
        """Batches this group skipped that the ledger does not count yet."""
        self._iterator: Iterator[Any] | None = None
        self._read = 0
        """Batches read from the dataloader since it was (re)positioned."""
        self._base = 0
        """Slice position of the dataloader's first batch (a disk checkpoint may start later)."""
        self._retry: list[Any] = []
        self._this_step: list[Any] = []
        self._state_at_position: Any = None
        """Dataloader state at the consumed position, taken before the first read past it."""

    # position ----------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Batches of this group's slice consumed by committed steps (the next one's index)."""
        return self._base + self._read - len(self._retry) - len(self._this_step)

    def __iter__(self) -> CommittedBatches:
        return self

    def __next__(self) -> Any:
        self._catch_up()
        batch = self._retry.pop(0) if self._retry else self._read_one()
        self._this_step.append(batch)
        return batch

    def _read_one(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.dataloader)
        if not self._retry and not self._this_step and hasattr(self.dataloader, "state_dict"):
            self._state_at_position = self.dataloader.state_dict()
        batch = next(self._iterator)
        self._read += 1
        return batch

    def _catch_up(self) -> None:
        """Move the reader to ``consumed[replica_id]`` (plus the skips not yet reported)
        after a heal or a disk resume."""
        target = self.consumed[self.replica_id] + self._unreported
        if self._this_step or target == self.position:
            return
        if target < self.position:
            raise RuntimeError(
                f"replica group {self.replica_id} has read its slice up to batch "
                f"{self.position} but only {target} were consumed; a dataloader cannot rewind"
            )
        while self._retry and target > self.position:
            self._retry.pop(0)
        while target > self.position:
            self._read_one()

    def skips_to_report(self) -> int:
        """Batches this group skipped by request that the ledger does not count yet; sent with
        the step's participation (only a participant's report reaches the others)."""
        return self._unreported

    def end_step(
        self, committed: bool, participants: list[int], reported_skips: list[int] | None = None
    ) -> int:
        """Settle this step's batches and return how many this group skipped by request.

        ``participants``: replica ids whose gradients were in the step's average;
        ``reported_skips[g]``: the skips participant ``g`` reported in this step (each group's
        :meth:`skips_to_report`, summed over the participants; None = none). Both are the same
        on every group, and only used when ``committed``.
        """
        batches, self._this_step = self._this_step, []
        if committed:
            for replica in participants:
                self.consumed[replica] += len(batches)
            for replica, count in enumerate(reported_skips or []):
                self.consumed[replica] += count
                self.skipped[replica] += count
            self._unreported -= (reported_skips or [0] * len(self.consumed))[self.replica_id]
        if committed and self.replica_id in participants:
            return 0
        if committed and self.skip_left_out:
            self._unreported += len(batches)
            return len(batches)
        self._retry = batches + self._retry
        return 0

    # healing (the ledger) and disk checkpoints (ledger + this group's reader) ----------------

    def state_dict(self) -> dict[str, Any]:
        """The ledger (what a healing peer needs; small, plain ints)."""
        return {"consumed": list(self.consumed), "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a peer's (or a checkpoint's) ledger; the reader catches up at the next read.
        A ledger without ``skipped`` (a disk checkpoint) counts no skips."""
        consumed = [int(c) for c in state["consumed"]]
        skipped = [int(c) for c in state.get("skipped", [0] * len(consumed))]
        if len(consumed) != len(self.consumed) or len(skipped) != len(consumed):
            raise ValueError(
                f"ledger of {len(consumed)} replica groups ({len(skipped)} skip counts), this "
                f"job has {len(self.consumed)}"
            )
        self.consumed = consumed
        self.skipped = skipped

    def reader_state(self) -> dict[str, Any]:
        """This group's dataloader state at the consumed position, for a disk checkpoint."""
        if self._retry or self._this_step or self._iterator is None:
            loader = self._state_at_position
        else:
            loader = self.dataloader.state_dict()
        return {"position": self.position, "loader": loader}

    def load_reader_state(self, state: dict[str, Any]) -> None:
        """Restart the reader from :meth:`reader_state` output (before the first read)."""
        if self._iterator is not None:
            raise RuntimeError("load_reader_state must be called before the first batch")
        if state.get("loader") is not None:
            self.dataloader.load_state_dict(state["loader"])
        self._state_at_position = state.get("loader")
        self._base = int(state["position"])
        self._read = 0


def main(argv: list[str] | None = None) -> None:
    """CLI: ``--write-tokenizer`` retrains the shipped tokenizer; ``--write-corpus`` caches."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-tokenizer", action="store_true", help=f"into {TOKENIZER_DIR}")
    parser.add_argument("--write-corpus", action="store_true", help=f"into {cache_dir()}")
    args = parser.parse_args(argv)
    if args.write_tokenizer:
        print(train_tokenizer(TOKENIZER_DIR))
    if args.write_corpus:
        for name, (seed, documents) in _CORPORA.items():
            print(write_corpus(corpus_path(name), seed, documents))


if __name__ == "__main__":
    main()
