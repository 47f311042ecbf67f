"""Training/eval data in the project's format (id, prompt, answer, source): the DeepScaleR preparation
(prepare, records) and the prompt stream the generators read (prompts); a run loads and checks its inputs
with run/inputs.py. The tiny synthetic task is in demo/."""
