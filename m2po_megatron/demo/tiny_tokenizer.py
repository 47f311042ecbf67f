"""A tiny real HF tokenizer for the synthetic task, built locally (no download).

It is a Qwen2-style byte-level BPE (transformers' ``Qwen2Tokenizer``, a ``PreTrainedTokenizerFast``
backed by the `tokenizers` library): the 256 byte symbols, one merged token for each prompt word (with and
without a leading space) and for ``\\boxed``, and <pad>, <s>, </s>, <unk>, <|user|>, <|assistant|>, with a
two-role chat template. Digits are split one per token (Qwen's pre-tokenizer), operators are byte tokens,
and decode(encode(text)) == text. Why Qwen2 and not a word-level model: with transformers 5,
``AutoTokenizer`` on a directory whose config.json says ``model_type: qwen2`` rebuilds the tokenizer as
``Qwen2Tokenizer`` from tokenizer.json's vocab and merges, whatever class saved it; a word-level vocab
then tokenizes differently after reloading. Building it as ``Qwen2Tokenizer`` makes save/load exact.
"""

from __future__ import annotations

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
SPECIALS = [PAD, BOS, EOS, UNK, USER, ASSISTANT]
WORDS = ["Compute", "Put", "the", "answer", "in", "What", "is", "Please", "solve", "following", "math",
         "problem", "Return", "final", "tags", "for", "example", "step", "by", "Answer", "and", "of",
         "boxed", "frac"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_symbols() -> list[str]:
    """The printable stand-in of each byte value 0..255 used by byte-level BPE (GPT-2's reversible map)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_tiny_tokenizer():
    """A ``Qwen2Tokenizer`` (save it with ``save_pretrained``; AutoTokenizer loads it back identically)."""
    from transformers import Qwen2Tokenizer

    sym = byte_symbols()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for s in sym:
        vocab[s] = len(vocab)
    merges: list[tuple[str, str]] = []

    def merge(left: str, right: str) -> str:
        if left + right not in vocab:
            merges.append((left, right))
            vocab[left + right] = len(vocab)
        return left + right

    space, backslash = sym[ord(" ")], sym[ord("\\")]
    # Qwen's pre-tokenizer yields "word", " word", "\\word" and " \\" + "word"; merge each into one token,
    # letters first (BPE applies merges in the order listed).
    for word in WORDS:
        cur = word[0]
        for ch in word[1:]:
            cur = merge(cur, ch)
        merge(space, word)
    for word in ("boxed", "frac"):
        merge(backslash, word)
    merge(space, backslash)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=UNK, bos_token=BOS, eos_token=EOS,
                         pad_token=PAD, extra_special_tokens=[USER, ASSISTANT],
                         padding_side="left")  # decoder-only generation pads on the left
    tok.chat_template = CHAT_TEMPLATE
    return tok
