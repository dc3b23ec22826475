"""The data's one-line errors (main.py turns them into exit code 2)."""


class DatasetNotPreparedError(Exception):
    """Raised with one line: which dataset, where we looked, the command that prepares it."""


class DatasetChangedError(DatasetNotPreparedError):
    """`prepare` refuses to reuse the prepared copy of an image folder that has changed."""
