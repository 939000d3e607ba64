"""Grade a math answer against a ground truth for mathematical equivalence, not text.

The grader is ``math-verify`` (Hugging Face's maintained answer checker, built on sympy): it
finds the final answer in the response (the last ``\\boxed{}``, else the last expression),
parses LaTeX and plain expressions, and compares values — so ``\\frac{1}{2}``, ``0.5`` and
``1/2`` agree, ``1,000`` is ``1000``, units written as ``\\text{cm}`` or words are dropped, and
``\\boxed{15}`` does NOT match a ground truth of ``5`` (a substring check says it does).

math-verify's own timeouts use ``signal.alarm``, which works only on the main thread, and env
servers grade on worker threads; they are therefore off here, and the response is cut to its
last ``MAX_RESPONSE_CHARS`` characters (where the final answer is) to bound the work instead.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from opentinker.errors import ConfigError

MAX_RESPONSE_CHARS = 4000
MAX_GROUND_TRUTH_CHARS = 500


def is_equivalent(response: str, ground_truth: str) -> bool:
    """Whether the final answer in ``response`` equals ``ground_truth`` mathematically.

    ground_truth: LaTeX or a plain expression (``\\frac{3}{4}``, ``0.75``, ``12 \\text{ cm}``),
    with or without ``$...$`` or ``\\boxed{}``. A response with no parsable answer is wrong.
    """
    parse, verify = _math_verify()
    gold = parse(
        _as_latex(_normalized(ground_truth[:MAX_GROUND_TRUTH_CHARS])), parsing_timeout=None
    )
    if not gold:
        raise ValueError(f"the ground truth {ground_truth!r} is not a parsable math answer")
    answer = parse(_final_part(response), parsing_timeout=None)
    if not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=None))


def extracted_answer(response: str) -> str:
    """The final answer math-verify finds in a response, as text ('' when none), for logs."""
    parse, _ = _math_verify()
    found = parse(_final_part(response), parsing_timeout=None)
    return str(found[-1]) if found else ""


def _final_part(response: str) -> str:
    """Where the final answer is: from the last ``\\boxed`` on (math-verify would otherwise
    read several boxed answers as one set), within the last ``MAX_RESPONSE_CHARS``."""
    tail = response[-MAX_RESPONSE_CHARS:]
    last_boxed = tail.rfind("\\boxed")
    return _normalized(tail[last_boxed:] if last_boxed >= 0 else tail)


def _normalized(text: str) -> str:
    # A LaTeX dollar sign used as currency ("\$12") is not math-mode; drop it.
    return text.replace("\\$", "")


def _as_latex(ground_truth: str) -> str:
    text = ground_truth.strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


@functools.cache
def _math_verify() -> tuple[Any, Any]:
    """(parse, verify) of math-verify, imported on first use (a server-side dependency)."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ConfigError(
            "the math environments grade with math-verify: pip install 'math-verify[antlr4_13_2]'"
        ) from exc
    # It warns once per process that its timeouts are off; that is on purpose (see above).
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return parse, verify
