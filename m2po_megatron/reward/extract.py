"""Find the final answer of a response: the content of its last ``\\boxed{...}``.

Pure string code (no sympy), so it is cheap and safe to run anywhere, including the trainer's main loop.
"""

from __future__ import annotations

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces included.

    Returns None when there is no box, when the last box is never closed (a truncated response), or when
    the box is empty. ``\\boxed 5`` (the brace-less TeX form) yields "5".
    """
    if not text:
        return None
    start = -1
    cmd_len = 0
    for cmd in _BOX_COMMANDS:
        pos = text.rfind(cmd)
        # "\boxed" inside e.g. "\boxedtext" is not the command; rfind may hit such a name, so check the next char.
        while pos != -1:
            nxt = pos + len(cmd)
            if nxt >= len(text) or not text[nxt].isalpha():
                break
            pos = text.rfind(cmd, 0, pos)
        if pos > start:
            start, cmd_len = pos, len(cmd)
    if start == -1:
        return None
    i = start + cmd_len
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # Brace-less form: "\boxed 5" takes the next token up to whitespace or "$".
        j = i
        while j < len(text) and not text[j].isspace() and text[j] != "$":
            j += 1
        content = text[i:j].strip()
        return content or None
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2  # an escaped char ("\{", "\}", "\\") never opens or closes a group
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                content = text[i + 1 : j].strip()
                return content or None
        j += 1
    return None  # unbalanced: the response was cut before the box closed
