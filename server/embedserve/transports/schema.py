"""What every HTTP route accepts of texts, said in its schema (one definition for http_api,
http_rerank and http_tei): non-blank texts, 1..MAX_TEXTS_PER_REQUEST of them (`texts(most)`: each
server's own bound, so its OpenAPI document states it; MAX_ITEMS in the classes' defaults). A
list stops at its first bad item (fail_fast): each member of a union otherwise reported every
item, 200,000 errors for a 1 MB body, seconds of the loop to list them."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

MAX_ITEMS = 2048  # a hard ceiling; MAX_TEXTS_PER_REQUEST (default 512) applies below it (400)
Text = Annotated[str, StringConstraints(min_length=1, pattern=r"\S")]


def texts(most: int):
    """1..`most` non-blank texts."""
    return Annotated[list[Text], Field(min_length=1, max_length=most, fail_fast=True)]


Texts = texts(MAX_ITEMS)
