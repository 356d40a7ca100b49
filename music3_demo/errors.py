"""The one-sentence errors more than one layer raises: `InvalidRequest`, a request the user must change (request.py
checks the limits, prompt.py the text that would turn into the model's control tokens)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the user must change; str(error) is one sentence saying what to change, `field` the request field
    it is about (None when it is about the whole request), so a form or an API can point at the right input."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
