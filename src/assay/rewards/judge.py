"""Generative judges: a language model behind any OpenAI-compatible server scores completions.

    reward: {name: judge, args: {url: http://127.0.0.1:8000, model: NAME, mode: pointwise}}

Three modes, after "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena" (Zheng et al.,
2023, arXiv:2306.05685), whose single-answer and pairwise prompts are the default templates:

* `pointwise` (single-answer grading): one request per completion; the judge's rating, a
  number in `[low, high]`, becomes `(rating − low) / (high − low)` in [0, 1].
* `pairwise`: the completion against a reference answer (`against: reference`, the row's
  `reference_field`), or round robin against every other completion of its group
  (`against: group`, G(G−1)/2 requests a group); a win is 1, a tie 0.5, a loss 0, and a
  completion's score is its mean over its comparisons. With `swap: true` each comparison is
  asked in both orders and counts as a win only when the judge prefers it both times, else a
  tie — the paper's conservative fix for position bias.
* `groupwise` (listwise): the G completions of a group in one request; the judge ranks them
  best first and the completion ranked i-th (from 0) scores (G − 1 − i) / (G − 1). The
  listwise "Ranking Reward Model" of RLRR (RL with Relative Rewards; seed catalogue entry,
  its full title not recorded there), which ranks within the group instead of scoring apart.

A sample the judge cannot score is **unscored** (score None, left out of baselines and
counted in `reward/none`, `reward/failures` and `reward/reason/<reason>`), never 0:
`timeout` (no reply in time), `http_error` (refused, 4xx, 5xx after the retries, a reply
without text), `unparsable` (no rating in range, no verdict, no full ranking),
`no_reference`, `group_of_one`. The judge is `kind = "batch"`: the executor gives it whole
batches in the trainer's process, so it sees groups whole and runs its own concurrency
(`assay.rewards.judge_client`, which also retries, times out and caches).

    >>> parse_ranking("[[2, 3, 1]]", 3), parse_ranking("21", 2), parse_ranking("1, 1", 2)
    ([2, 3, 1], [2, 1], None)
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from assay.rewards.base import REWARDS, Reward
from assay.rewards.judge_client import JudgeClient, Pictured, Reply
from assay.types import RewardResult, Trajectory

MODES = ("pointwise", "pairwise", "groupwise")
AGAINST = ("reference", "group")

POINTWISE = (
    "[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided by an AI assistant to the "
    "user question displayed below. Be as objective as possible. After a short explanation, you must rate the response on a "
    "scale of {low} to {high} by strictly following this format: \"[[rating]]\", for example: \"Rating: [[{high}]]\".\n\n"
    "[Question]\n{prompt}\n\n[The Start of Assistant's Answer]\n{completion}\n[The End of Assistant's Answer]")
PAIRWISE = (
    "[System]\nPlease act as an impartial judge and evaluate the quality of the responses provided by two AI assistants to the "
    "user question displayed below. Avoid any position biases and ensure that the order in which the responses were presented "
    "does not influence your decision. Do not allow the length of the responses to influence your evaluation. After a short "
    "explanation, output your final verdict by strictly following this format: \"[[A]]\" if assistant A is better, \"[[B]]\" "
    "if assistant B is better, and \"[[C]]\" for a tie.\n\n[User Question]\n{prompt}\n\n[The Start of Assistant A's Answer]\n{a}\n"
    "[The End of Assistant A's Answer]\n\n[The Start of Assistant B's Answer]\n{b}\n[The End of Assistant B's Answer]")
GROUPWISE = (
    "[System]\nPlease act as an impartial judge and rank the {n} responses below to the user question, best first. Do not let "
    "their order or length influence you. After a short explanation, output the ranking of all {n} response numbers by "
    "strictly following this format: \"[[3, 1, 2]]\".\n\n[User Question]\n{prompt}\n\n{completions}")
TEMPLATES = {"pointwise": POINTWISE, "pairwise": PAIRWISE, "groupwise": GROUPWISE}
REQUIRED = {"pointwise": ("completion",), "pairwise": ("a", "b"), "groupwise": ("completions",)}
FIELDS = re.compile(r"\{(prompt|completion|answer|a|b|completions|n|low|high|criterion)\}")
NUMBER = r"-?\d+(?:\.\d+)?"


def render(template: str, **values: Any) -> str:
    """`template` with each `{name}` of a known field replaced once (other braces are left as they are)."""
    return FIELDS.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), template)


def prompt_text(traj: Trajectory) -> str:
    """The prompt as text: a conversation becomes `role: content` lines (a picture in it, `<image>`)."""
    p = traj.sample.prompt
    return "\n".join(f"{m.get('role')}: {_content_text(m.get('content'))}" for m in p) if isinstance(p, list) else str(p)


def _content_text(content: Any) -> str:
    if not isinstance(content, list):
        return str(content)
    return "".join("<image>" if isinstance(p, dict) and p.get("type") == "image" else str(p.get("text", "")) if isinstance(p, dict) else str(p)
                   for p in content)


def with_pictures(traj: Trajectory, text: str) -> str | Pictured:
    """`text`, with the pictures of `traj`'s prompt when it has any (the judge then sees what the policy saw)."""
    from assay.vision.inputs import data_url, image_parts

    parts = image_parts(traj.sample.prompt)
    return Pictured(text, tuple(data_url(p["image"]) for p in parts)) if parts else text


def parse_rating(text: str, low: float, high: float, pattern: str | None = None) -> float | None:
    """The judge's rating in `[low, high]`: `pattern`'s first group, else a `[[N]]`, else the first number; None when out of range or absent."""
    found = re.search(pattern, text) if pattern else (re.search(rf"\[\[\s*({NUMBER})\s*\]\]", text) or re.search(f"({NUMBER})", text))
    if found is None:
        return None
    try:
        x = float(found.group(1) if found.groups() else found.group(0))
    except (TypeError, ValueError):
        return None
    return x if low <= x <= high else None


def parse_verdict(text: str, labels: list[str]) -> int | None:
    """Which of `labels` (first better, second better, tie) the judge chose: a `[[L]]`, else the first label standing alone."""
    alt = "|".join(re.escape(x) for x in labels)
    found = re.search(rf"\[\[\s*({alt})\s*\]\]", text) or re.search(rf"(?<![A-Za-z0-9])({alt})(?![A-Za-z0-9])", text)
    return None if found is None else labels.index(found.group(1))


def parse_ranking(text: str, n: int) -> list[int] | None:
    """A ranking of responses 1..n, best first: the numbers of a `[[...]]` (else of the whole reply); with n ≤ 9 a
    single run of n digits is read digit by digit. None unless it is a permutation of 1..n."""
    inner = re.search(r"\[\[(.*?)\]\]", text, re.S)
    part = inner.group(1) if inner else text
    numbers = re.findall(r"\d+", part)
    if n <= 9 and len(numbers) == 1 and len(numbers[0]) == n:
        numbers = list(numbers[0])
    ranking = [int(x) for x in numbers[:n]]
    return ranking if sorted(ranking) == list(range(1, n + 1)) else None


def unscored(reason: str, error: str, **info: Any) -> RewardResult:
    """A result the judge could not give: score None, the reason in `info["reason"]` and `error`."""
    return RewardResult(None, info={"reason": reason, **info}, error=error)


def _failed(reply: Reply) -> RewardResult:
    return unscored(reply.reason or "http_error", reply.error or "no reply", attempts=reply.attempts)


@REWARDS.register("judge")
class Judge(Reward):
    """A model judge over an OpenAI-compatible server: pointwise, pairwise or groupwise (see the module docstring).

    Args:
        url, model, api, system, max_tokens, temperature, seed, stop, timeout, retries, backoff,
            concurrency, cache, cache_dir, api_key_env: the server and its requests (`JudgeClient`).
        pictures: send the prompt's pictures with each judge prompt (OpenAI `image_url` parts; needs `api=chat` and a
            judge that takes pictures), so the judge sees what the policy saw; false: the text alone, pictures as `<image>`.
        mode: `pointwise`, `pairwise` or `groupwise`.
        template: the judge prompt; `{prompt}`, `{answer}` and, by mode, `{completion}` (pointwise),
            `{a}`/`{b}` (pairwise), `{completions}`/`{n}` (groupwise), `{low}`/`{high}` are filled in.
        low, high: the pointwise rating scale. pattern: a regex whose first group is the rating.
        against: pairwise opponent, `reference` or `group`. reference_field: the row field of the
            reference answer (`answer` is the sample's answer). swap: ask each comparison in both orders.
        labels: pairwise verdicts meaning first better, second better, tie.
        batch_timeout: seconds for a whole batch; requests not answered by then are unscored (`timeout`).
    """

    kind = "batch"
    verdict = False  # a rating or a preference, not right/wrong
    #: the conformance suite's block: nothing listens on port 9, so every item is unscored (http_error)
    example_args = {"url": "http://127.0.0.1:9", "retries": 0, "timeout": 2.0}

    def __init__(self, url: str, model: str | None = None, mode: str = "pointwise", template: str | None = None, low: float = 1.0,
                 high: float = 10.0, pattern: str | None = None, against: str = "reference", reference_field: str = "answer",
                 swap: bool = False, labels: list[str] | None = None, batch_timeout: float | None = None, api: str = "chat",
                 system: str | None = None, max_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
                 stop: list[str] | str | None = None, timeout: float = 30.0, retries: int = 2, backoff: float = 0.5,
                 concurrency: int = 8, cache: bool = True, cache_dir: str | None = None, api_key_env: str | None = None,
                 pictures: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if against not in AGAINST:
            raise ValueError(f"against must be one of {', '.join(AGAINST)}, got {against!r}")
        if not low < high:
            raise ValueError(f"need low < high, got low={low}, high={high}")
        template = TEMPLATES[mode] if template is None else template
        if not isinstance(template, str):
            raise ValueError(f"template must be text, got {template!r}")
        missing = [f"{{{k}}}" for k in REQUIRED[mode] if f"{{{k}}}" not in template]
        if missing:
            raise ValueError(f"a {mode} template must contain {', '.join(missing)}")
        labels = list(labels) if labels is not None else ["A", "B", "C"]
        if len(labels) != 3 or len(set(labels)) != 3 or not all(isinstance(x, str) and x for x in labels):
            raise ValueError(f"labels must be three distinct strings (first better, second better, tie), got {labels!r}")
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None
        if batch_timeout is not None and batch_timeout <= 0:
            raise ValueError(f"batch_timeout must be > 0 seconds, got {batch_timeout}")
        self.mode, self.template, self.low, self.high, self.pattern = mode, template, float(low), float(high), pattern
        self.against, self.reference_field, self.swap, self.labels = against, reference_field, bool(swap), labels
        self.batch_timeout, self.pictures = batch_timeout, bool(pictures)
        self._client = JudgeClient(url, model=model, api=api, system=system, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                   stop=stop, timeout=timeout, retries=retries, backoff=backoff, concurrency=concurrency, cache=cache,
                                   cache_dir=cache_dir, api_key_env=api_key_env)

    def stats(self) -> dict[str, float]:
        """Since the last call: `reward/judge/requests` (HTTP requests, retries included), `retries`, `cache_hits`, `request_seconds`."""
        return {f"reward/judge/{k}": v for k, v in self._client.stats().items()}

    def hparams(self) -> dict[str, Any]:
        client = {k: v for k, v in vars(self._client).items() if not k.startswith("_")}
        return {**{k: v for k, v in vars(self).items() if not k.startswith("_") and k != "template"}, **client}

    # ---------------------------------------------------------------- scoring

    def score(self, traj: Trajectory) -> RewardResult:
        return self([traj])[0]

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        if self.mode == "pointwise":
            return self._pointwise(batch)
        if self.mode == "groupwise":
            return self._groupwise(batch)
        return self._pairwise(batch)

    def values(self, t: Trajectory) -> dict[str, Any]:
        """The template fields every mode fills from the row: prompt, answer, low, high."""
        return {"prompt": prompt_text(t), "answer": "" if t.sample.answer is None else t.sample.answer, "low": _num(self.low),
                "high": _num(self.high)}

    def _pointwise(self, batch: list[Trajectory]) -> list[RewardResult]:
        return self.rate([self.ask_form(t, render(self.template, **self.values(t), completion=t.completion)) for t in batch])

    def ask_form(self, traj: Trajectory, text: str) -> str | Pictured:
        """What is asked about `traj`: the rendered `text`, with the prompt's pictures unless `pictures=False`."""
        return with_pictures(traj, text) if self.pictures else text

    def rate(self, prompts: list[str | Pictured]) -> list[RewardResult]:
        """One pointwise result per judge prompt: the rating scaled to [0, 1], or unscored with the reason."""
        replies = self._client.ask_many(prompts, self.batch_timeout)
        out = []
        for r in replies:
            if r.text is None:
                out.append(_failed(r))
                continue
            x = parse_rating(r.text, self.low, self.high, self.pattern)
            if x is None:
                out.append(unscored("unparsable", f"no rating in [{_num(self.low)}, {_num(self.high)}] in the judge's reply {r.text[:200]!r}",
                                    reply=r.text[:200]))
            else:
                out.append(RewardResult((x - self.low) / (self.high - self.low), components={"rating": x},
                                        info={"reply": r.text[:200], "cached": r.cached}))
        return out

    # ---------------------------------------------------------------- pairwise

    def _reference(self, t: Trajectory) -> Any:
        return t.sample.answer if self.reference_field == "answer" else t.sample.fields.get(self.reference_field)

    def _pairwise(self, batch: list[Trajectory]) -> list[RewardResult]:
        """Comparisons `(i, j)`: item i against item j of the batch, or against its reference when j is None."""
        pairs: list[tuple[int, int | None]] = []
        early: dict[int, RewardResult] = {}
        if self.against == "reference":
            for i, t in enumerate(batch):
                if self._reference(t) is None:
                    early[i] = unscored("no_reference", f"row has no reference answer in field {self.reference_field!r}")
                else:
                    pairs.append((i, None))
        else:
            for members in _groups(batch).values():
                if len(members) == 1:
                    early[members[0]] = unscored("group_of_one", "a pairwise judge within the group needs two completions or more")
                pairs += [(i, j) for k, i in enumerate(members) for j in members[k + 1:]]
        prompts, asks = [], []  # asks[k] = (pair index, swapped)
        for p, (i, j) in enumerate(pairs):
            a, b = batch[i].completion, (str(self._reference(batch[i])) if j is None else batch[j].completion)
            v = self.values(batch[i])
            for swapped in ((False, True) if self.swap else (False,)):
                prompts.append(self.ask_form(batch[i], render(self.template, **v, a=b if swapped else a, b=a if swapped else b)))
                asks.append((p, swapped))
        replies = self._client.ask_many(prompts, self.batch_timeout)
        verdicts: dict[int, list[float | Reply | str]] = defaultdict(list)  # pair -> outcomes for its first item
        for (p, swapped), r in zip(asks, replies):
            if r.text is None:
                verdicts[p].append(r)
                continue
            v = parse_verdict(r.text, self.labels)
            verdicts[p].append(r.text if v is None else (0.5 if v == 2 else float((v == 0) != swapped)))
        outcomes: dict[int, list[float | Reply | str]] = defaultdict(list)
        for p, (i, j) in enumerate(pairs):
            o = _combine(verdicts[p])
            outcomes[i].append(o)
            if j is not None:
                outcomes[j].append(1.0 - o if isinstance(o, float) else o)
        return [early[i] if i in early else _mean_outcome(outcomes[i]) for i in range(len(batch))]

    # ---------------------------------------------------------------- groupwise

    def _groupwise(self, batch: list[Trajectory]) -> list[RewardResult]:
        out: list[RewardResult | None] = [None] * len(batch)
        groups = [m for m in _groups(batch).values()]
        for members in groups:
            if len(members) == 1:
                out[members[0]] = unscored("group_of_one", "a groupwise judge needs two completions or more in the group")
        asked = [m for m in groups if len(m) > 1]
        prompts = []
        for members in asked:
            listing = "\n\n".join(f"[Response {k + 1}]\n{batch[i].completion}" for k, i in enumerate(members))
            prompts.append(self.ask_form(batch[members[0]], render(self.template, **self.values(batch[members[0]]), completions=listing, n=len(members))))
        for members, r in zip(asked, self._client.ask_many(prompts, self.batch_timeout)):
            ranking = None if r.text is None else parse_ranking(r.text, len(members))
            g = len(members)
            for k, i in enumerate(members):
                if r.text is None:
                    out[i] = _failed(r)
                elif ranking is None:
                    out[i] = unscored("unparsable", f"no ranking of all {g} responses in the judge's reply {r.text[:200]!r}", reply=r.text[:200])
                else:
                    place = ranking.index(k + 1)
                    out[i] = RewardResult((g - 1 - place) / (g - 1), components={"rank": float(place + 1)}, info={"reply": r.text[:200]})
        return [r for r in out if r is not None]


def _groups(batch: list[Trajectory]) -> dict[int, list[int]]:
    """Batch indices by group, in batch order."""
    by: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(batch):
        by[t.group].append(i)
    return by


def _combine(verdicts: list[float | Reply | str]) -> float | Reply | str:
    """One comparison's outcome for its first item: a failed ask or unparsable reply wins; two orders that disagree tie."""
    for v in verdicts:
        if not isinstance(v, float):
            return v
    return verdicts[0] if all(v == verdicts[0] for v in verdicts) else 0.5


def _mean_outcome(outcomes: list[float | Reply | str]) -> RewardResult:
    scored = [o for o in outcomes if isinstance(o, float)]
    if scored:
        return RewardResult(sum(scored) / len(scored), components={"wins": sum(scored)}, info={"comparisons": len(scored), "failed": len(outcomes) - len(scored)})
    first = outcomes[0]
    if isinstance(first, Reply):
        return _failed(first)
    return unscored("unparsable", f"no verdict among the labels in the judge's reply {str(first)[:200]!r}", reply=str(first)[:200])


def _num(x: float) -> str:
    return f"{x:g}"
