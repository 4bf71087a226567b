"""The one thing every data source shares: the `Source` interface (documents split into train and
val). Its own module so that the built-in sources and the task sources both build on it without
importing each other."""

from __future__ import annotations

from collections.abc import Iterator


class Source:
    """Base class: a named collection of documents, split into train and val."""

    spec: str
    val_fraction: float

    def iter_documents(self, split: str) -> Iterator[str]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A string that changes whenever the documents of either split could change."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, val_fraction={self.val_fraction})"
