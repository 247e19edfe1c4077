"""``torchft.multiprocessing``: torchft keeps the pipe of its subprocess process groups here
(private). torchtitan_ft's subprocess groups (``ProcessGroupBaby*``) use their own; nothing is
exported."""

__all__: list[str] = []
