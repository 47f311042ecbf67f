"""A tiny real HF tokenizer for the synthetic task, built locally with the `tokenizers` library.

Word level over single digits, operators, whitespace, ``\\boxed`` and the prompt words, with <s>, </s>,
<pad>, <unk> and a two-role chat template. Whitespace is a token and the decoder concatenates, so
decode(encode(text)) == text for any text made of known symbols (the reward sees exactly what was sampled).
"""

from __future__ import annotations

import string

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
SPECIALS = [PAD, BOS, EOS, UNK, USER, ASSISTANT]
WORDS = ["Compute", "Put", "the", "answer", "in", "What", "is", "Please", "solve", "following", "math",
         "problem", "Return", "final", "tags", "for", "example", "step", "by", "Answer", "a", "and", "of"]
SYMBOLS = list(string.digits) + list("+-*/=()[]{}.,:?$^_ ") + ["\n", "\\boxed", "\\frac", "\\"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Longest alternatives first: "\boxed" before "\", words before letters.
SPLIT_PATTERN = r"\\boxed|\\frac|[A-Za-z]+|\d|\s|[^A-Za-z\d\s]"


def build_tiny_tokenizer():
    """A ``PreTrainedTokenizerFast`` (save it with ``save_pretrained``; AutoTokenizer loads it back)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, additional_special_tokens=[USER, ASSISTANT],
                                   padding_side="left")  # decoder-only generation pads on the left
    fast.chat_template = CHAT_TEMPLATE
    return fast
