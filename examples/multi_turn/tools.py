"""Tools for examples/multi_turn/tool_calling.yaml, as TRL's `tools=[...]` takes them: type hints and a
Google-style docstring become the chat template's tool schema."""


def vowels(word: str) -> str:
    """The vowels of a word.

    Args:
        word: the word to read
    """
    return "".join(ch for ch in word if ch in "aeiou")
