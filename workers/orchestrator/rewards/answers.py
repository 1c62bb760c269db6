"""Built-in answer rewards: ``exact_match`` and ``math_equal`` (``env.reward_fn=exact_match`` / ``math_equal``).

Both compare the completion with ``sample["answer"]`` (the record's ``env.answer_key`` field)
and return 1.0 or 0.0.

``math_equal`` first extracts the final answer from the completion, in this order: the last
``\\boxed{...}`` (braces balanced), the text after the last "answer is" / "Answer:" / "####",
the last ``$...$`` formula, else the last number in the text. Both sides are then normalised (``$``, ``\\left``/``\\right``,
``\\text{}``, ``\\dfrac``/``\\tfrac``, ``\\frac{a}{b}`` -> ``a/b``, thousands separators, a
trailing period, a leading ``x =``, a trailing ``%`` or unit-less degree sign) and compared as
exact fractions when both parse as numbers ("0.5" == "1/2" == "\\frac{1}{2}"; a rounded
"0.333" is not "1/3"), else as whitespace-free, case-folded strings.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_MARKERS = re.compile(r"(?:the\s+(?:final\s+)?answer\s+is|answer\s*:|####)", re.IGNORECASE)


def _answer(sample: dict) -> str:
    if "answer" not in sample:
        raise KeyError("sample has no 'answer' (set env.answer_key to the field holding the reference answer)")
    return str(sample["answer"])


def exact_match(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when the completion equals the answer after trimming and collapsing whitespace."""
    return float(" ".join(completion.split()) == " ".join(_answer(sample).split()))


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j]
    return None


def extract_answer(completion: str) -> str:
    """The final answer a completion gives (module docstring: the order tried)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    marks = list(_MARKERS.finditer(completion))
    if marks:
        tail = completion[marks[-1].end():].strip()
        return tail.splitlines()[0] if tail else ""
    formulas = re.findall(r"\$([^$]+)\$", completion)
    if formulas:
        return formulas[-1]
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else completion.strip()


def _replace_frac(s: str) -> str:
    """``\\frac{a}{b}`` -> ``(a)/(b)`` for simple brace groups, repeatedly (nested ones too)."""
    pattern = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
    while True:
        new = pattern.sub(lambda m: f"({m.group(1)})/({m.group(2)})", s)
        if new == s:
            return s
        s = new


def normalize(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right|!|,|;|\s)", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("$", "")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "")
    s = _replace_frac(s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = s.rstrip(".").rstrip("%").strip()
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # 1,000 -> 1000
    return s


def as_number(s: str) -> Optional[Fraction]:
    """``s`` as an exact number ("3", "-0.25", "3/4", "(1)/(2)"), or None."""
    t = s.replace(" ", "")
    m = re.fullmatch(r"\(?(-?[\d.]+)\)?(?:/\(?(-?[\d.]+)\)?)?", t)
    if not m:
        return None
    try:
        value = Fraction(m.group(1))
        if m.group(2) is not None:
            value /= Fraction(m.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return value


def equivalent(a: str, b: str) -> bool:
    """Two final answers are the same value (exact fractions) or the same text."""
    na, nb = normalize(a), normalize(b)
    x, y = as_number(na), as_number(nb)
    if x is not None and y is not None:
        return x == y
    return "".join(na.split()).casefold() == "".join(nb.split()).casefold()


def math_equal(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when the completion's final answer is equivalent to the sample's answer."""
    return float(equivalent(extract_answer(completion), _answer(sample)))
