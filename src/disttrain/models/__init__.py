"""Models with no distributed code, for examples, tests and benchmarks."""

from disttrain.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
