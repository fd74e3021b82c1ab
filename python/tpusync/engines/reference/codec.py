"""The reference server's text codec: one token per byte (Latin-1), exactly reversible."""

from __future__ import annotations


def encode(text: str) -> list[int]:
    """Text to token ids: Latin-1 bytes, or UTF-8 bytes for text outside Latin-1."""
    try:
        return list(text.encode("latin-1"))
    except UnicodeEncodeError:
        return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    """Token ids (< 256) to text; decode(encode(s)) == s for any Latin-1 string."""
    return bytes(tokens).decode("latin-1")
