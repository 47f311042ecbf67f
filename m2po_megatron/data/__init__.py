"""Training/eval data in the project's format (id, prompt, answer, source): the DeepScaleR preparation
(prepare, records), the prompt stream the generators read (prompts) and a run's inputs, loaded and checked
before Ray starts (loading). The tiny synthetic task is in demo/."""
