"""The embedded default's tiny task: a synthetic arithmetic dataset, a tiny tokenizer and a tiny Qwen2 model, built
from configs on CPU. Demo scaffolding only: nothing below the loop imports it."""
