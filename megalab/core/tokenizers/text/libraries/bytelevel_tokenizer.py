"""The simplest tokenizer that round-trips any text: token id = UTF-8 byte (vocab_size 256).

The engine and the server take any tokenizer with `encode(str) -> list[int]` and
`decode(list[int]) -> str` (chapter 05's BPE tokenizer fits too).
"""

from __future__ import annotations


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")  # a cut multi-byte character shows as U+FFFD
