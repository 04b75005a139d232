"""Math answer verification: our strict extraction and policy, math-verify's equivalence.

Extraction is ours, equivalence is math-verify's (Hugging Face's Math-Verify library). The
steps, each in its own module:

1. `extract`: the response is the completion without its thinking (`<think>…</think>` and
   the other tag families in `THINK_TAGS`; an unclosed opening tag ends the response), so
   nothing said while thinking, corrections included, can change the score. The answer
   is the last brace-balanced `\\boxed{…}` / `\\fbox{…}` of the response; with
   `no_box="anchored"` (default) a response without a box may state its answer as "the
   answer is …" / "Answer: …" / "… is the answer" (never "any number in the text"), or be
   nothing but the answer (one line of at most 40 characters with no word of three or more
   letters). A correction after the answer replaces it (`\\boxed{166}. Actually no, it is
   167.`), as does a later box after prose or a later "final answer is …"; hedges (`\\boxed{5} or 6`, `…, or possibly 6`) score 0.
2. `numbers`: digit groups read by one rule on both sides (`12,345` and `12\\,345` are one
   number, `12, 345` two); plain numbers compared exactly as rationals.
3. `parts`: what kind of answer a text is: one value, a list / set of solutions (any
   order), a tuple (in order), an interval, a relation, a matrix. A reference with several
   parts (several boxes, `a \\text{ and } b`, `\\{1, 2\\}`, `(3, -1)`, `1 \\pm \\sqrt{2}`) is one
   answer: the prediction must give all of its parts and no others.
4. `policy`: hedges (`2 or 3`, `\\pm` or a list for a one-value reference, `maybe`, `?`)
   and inputs too costly for sympy are refused.
5. `reward`: `MathReward` parses each reference once and judges: string, exact number,
   then math-verify (relations allowed against intervals; an equivalence of two exact
   constants re-checked at 60 digits, since math-verify calls `1/2^{99}` and `1/2^{98}` equal).

An unparseable reference scores None (left out of baselines, counted), never 0 or 1.
The reference formats are those of MATH (Hendrycks et al. 2021, "Measuring Mathematical
Problem Solving With the MATH Dataset", arXiv:2103.03874) and PRM800K (Lightman et al.
2023, "Let's Verify Step by Step", arXiv:2305.20050); the thinking format is DeepSeek-R1's
(DeepSeek-AI 2025, arXiv:2501.12948).

    >>> from assay.types import Sample, Trajectory
    >>> t = lambda c, a: Trajectory(Sample("0", "", a), c, [], [], [], True)
    >>> m = MathReward()
    >>> [m.score(t(c, "2")).score for c in [r"so \\boxed{2}", r"\\boxed{2} or \\boxed{3}", "The answer is 2 or 3."]]
    [1.0, 0.0, 0.0]
    >>> [m.score(t(c, r"6 \\text{ and } 8")).score for c in [r"\\boxed{6,8}", r"\\boxed{8, 6}", r"\\boxed{6}"]]
    [1.0, 1.0, 0.0]
"""

from assay.rewards.math.extract import THINK_TAGS, Extraction, after_answer, extract_answer, find_boxes, response_span
from assay.rewards.math.numbers import clean, group_digits, numbers_match, unicode_to_latex
from assay.rewards.math.parts import split_answer
from assay.rewards.math.policy import hedge_reason, too_complex
from assay.rewards.math.reward import Gold, MathReward, as_text, exact_recheck

__all__ = [
    "THINK_TAGS", "Extraction", "Gold", "MathReward", "after_answer", "as_text", "clean", "exact_recheck", "extract_answer",
    "find_boxes", "group_digits", "hedge_reason", "numbers_match", "response_span", "split_answer", "too_complex",
    "unicode_to_latex",
]
