"""``torchft.work``: torchft keeps only a private completed-Work helper here, ``_DummyWork``,
which programs and torchft's own tests use to return an already finished Work; it is
torchtitan_ft's ``CompletedWork`` (``wait()`` is True, the future holds the value)."""

from torchtitan_ft.process_group.base import CompletedWork as _DummyWork

__all__ = ["_DummyWork"]
