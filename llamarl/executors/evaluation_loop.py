"""Evaluation on held-out problems: one sampling-and-scoring loop for greedy accuracy and pass@k.

``score_samples`` is the loop every evaluation runs: the generator's greedy accuracy during a run
(``GeneratorExecutor.evaluate``, through whatever engine it holds) and the pass@k of a saved policy
after it (``evaluate_policy``, with the native engine, built through the engine registry).

``pass_at_k(n, c, k)`` is the unbiased estimator of Chen et al. (2021): with ``n`` samples of
which ``c`` are correct, ``1 - C(n - c, k) / C(n, k)``. ``evaluate_policy`` loads a policy (a base
model, optionally with a trainer's HF safetensors export on top, since that export carries no
tokenizer), then measures greedy accuracy and pass@k for every requested k, sampling
``n = max(ks)`` completions per problem through the engine contract's ``generate``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from llamarl.data.prompts import Problem
from llamarl.engines.base import EngineSetup, Request, SamplingParams, build_engine
from llamarl.models.loading import load_causal_lm, stop_token_ids
from llamarl.rewards.funcs import FuncsScore
from llamarl.rewards.trajectory import TrajectoryScore, trajectory_of
from llamarl.runtime.progress import eval_bar

Score = Callable[[str, str], float] | TrajectoryScore | FuncsScore
"""A text scorer ``(completion text, answer)``, a trajectory scorer ``(Trajectory, Problem)``
wrapped in ``TrajectoryScore`` (``--reward.trajectory-scorer``), or ``--reward.funcs``' weighted sum
(``FuncsScore``: the completion, its problem, the dataset row's columns)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct; ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def load_policy(base: str, *, weights_dir: str | Path | None = None, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` of ``base`` with, if given, the ``model.safetensors`` of ``weights_dir``
    (a checkpoint's ``trainer/hf`` export) loaded over it. ValueError if the export does not match
    the base architecture (unknown names, or any non-tied parameter left unset)."""
    model, tokenizer = load_causal_lm(base, dtype=dtype, device=device)
    if weights_dir is not None:
        state = load_file(str(Path(weights_dir) / "model.safetensors"), device=str(device))
        result = model.load_state_dict(state, strict=False)
        tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - {
            name for name, p in model.named_parameters()}
        missing = set(result.missing_keys) - tied
        if result.unexpected_keys or missing:
            raise ValueError(f"weights in {weights_dir} do not match {base}: unexpected "
                             f"{result.unexpected_keys[:3]}, missing {sorted(missing)[:3]}")
    return model.eval(), tokenizer


@torch.no_grad()
def score_samples(engine, tokenizer, *, problems: list[Problem], prompts: list[list[int]], score: Score,
                  sampling: SamplingParams, copies: int = 1, chunk: int = 64, version: int = 0,
                  generator: torch.Generator | None = None, segments: list | None = None,
                  progress: str | None = None) -> tuple[list[list[float]], list[str]]:
    """Generate ``copies`` completions of each prompt (``prompts[i]`` is ``problems[i]``'s) with
    ``engine`` (any engine with ``generate(requests, sampling=, version=, generator=)``), at most
    ``chunk`` sequences a batch, and score each against its problem's answer (a ``TrajectoryScore``:
    its ``Trajectory`` against the problem). Returns the scores
    (``[problem][copy]``) and the decoded texts (sample id ``i * copies + j``); ``segments``, a
    list, is filled likewise with each completion's ``Trajectory.segments`` (the policy's text and
    the environment's observations apart). ``progress``: the description of a tqdm bar over the
    samples (``llamarl.runtime.progress.eval_bar``), for the rank that reports; None: no bar."""
    requests = [Request(sample_id=i * copies + j, prompt_ids=list(prompts[i]))
                for i in range(len(problems)) for j in range(copies)]
    scores = [[0.0] * copies for _ in problems]
    texts: list[str] = [""] * len(requests)
    if segments is not None:
        segments[:] = [[] for _ in requests]
    bar = eval_bar(len(requests), desc=progress) if progress is not None else None
    try:
        for lo in range(0, len(requests), chunk):
            _score_chunk(engine, tokenizer, requests[lo : lo + chunk], problems=problems, score=score,
                         sampling=sampling, copies=copies, version=version, generator=generator,
                         scores=scores, texts=texts, segments=segments)
            if bar is not None:
                bar.update(min(chunk, len(requests) - lo))
    finally:
        if bar is not None:
            bar.close()
    return scores, texts


def _score_chunk(engine, tokenizer, requests: list[Request], *, problems: list[Problem], score: Score,
                 sampling: SamplingParams, copies: int, version: int, generator: torch.Generator | None,
                 scores: list[list[float]], texts: list[str], segments: list | None) -> None:
    """One batch of ``score_samples``: generate ``requests``, fill their ``scores`` / ``texts`` / ``segments``."""
    kwargs = {"generator": generator} if generator is not None else {}
    outs = engine.generate(requests, sampling=sampling, version=version, **kwargs)
    decoded = tokenizer.batch_decode([o.completion_ids for o in outs], skip_special_tokens=True)
    for out, text in zip(outs, decoded):
        i, j = divmod(out.sample_id, copies)
        texts[out.sample_id] = text
        trajectory = trajectory_of(out, tokenizer) if segments is not None or isinstance(score, TrajectoryScore) \
            else None
        if segments is not None:
            segments[out.sample_id] = trajectory.segments
        if isinstance(score, TrajectoryScore):
            scores[i][j] = float(score(trajectory, problems[i]))
        elif isinstance(score, FuncsScore):
            scores[i][j] = float(score(text, problems[i], out.completion_ids))
        else:
            scores[i][j] = float(score(text, problems[i].answer))


@torch.no_grad()
def evaluate_policy(model, tokenizer, *, problems: list[Problem], prompt_fn, score: Score, ks: list[int],
                    temperature: float, max_new_tokens: int, seed: int = 0, chunk: int = 64,
                    samples_path: Path | None = None, progress: str | None = None) -> dict[str, float]:
    """Greedy accuracy and pass@k (for each k in ``ks``) of ``model`` on ``problems``.

    ``n = max(ks)`` samples per problem at ``temperature`` (seeded), at most ``chunk`` sequences a
    batch. Returns ``{"greedy_accuracy": ..., "pass@k": ...}``; ``samples_path`` gets one JSON line per
    problem (greedy completion, sampled scores). ``progress``: a label for the tqdm bars of its two
    passes (greedy, then ``n`` samples each); None: no bars.
    """
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must be non-empty positive integers, got {ks}")
    n = max(ks)
    eos = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    param = next(model.parameters())
    device = param.device
    # The native engine with its default settings, sampling from ``model`` itself.
    engine = build_engine("torch", EngineSetup(
        model=model, model_path=str(getattr(getattr(model, "config", None), "_name_or_path", "")),
        dtype=str(param.dtype).removeprefix("torch."), eos_token_ids=eos, pad_token_id=pad, seed=seed, device=device))
    rng = torch.Generator(device=device).manual_seed(seed)
    prompts = [list(prompt_fn(tokenizer, p.question)) for p in problems]

    def run(sampling: SamplingParams, copies: int) -> tuple[list[list[float]], list[str]]:
        what = "greedy" if sampling.temperature == 0 else f"{copies} samples each"
        return score_samples(engine, tokenizer, problems=problems, prompts=prompts, score=score, sampling=sampling,
                             copies=copies, chunk=chunk, generator=None if sampling.temperature == 0 else rng,
                             progress=f"{progress}, {what}" if progress is not None else None)

    try:
        greedy, greedy_texts = run(SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens), 1)
        sampled, _ = run(SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens), n)
    finally:
        engine.close()
    result = {"greedy_accuracy": sum(s[0] for s in greedy) / max(len(problems), 1)}
    for k in sorted(set(ks)):
        values = [pass_at_k(n, sum(1 for x in s if x >= 1.0), k) for s in sampled]
        result[f"pass@{k}"] = sum(values) / max(len(values), 1)
    if samples_path is not None:
        samples_path.write_text("".join(
            json.dumps({"question": p.question, "reference": p.answer, "greedy": t, "greedy_score": g[0],
                        "sampled_scores": s}) + "\n"
            for p, t, g, s in zip(problems, greedy_texts, greedy, sampled)))
    return result
