"""Training/eval data in the project's format (id, prompt, answer, source), the DeepScaleR preparation,
and the embedded default's synthetic task (tiny tokenizer + tiny Qwen2 model)."""
