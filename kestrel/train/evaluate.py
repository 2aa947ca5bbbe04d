"""`kestrel eval`: accuracy of a checkpoint on the held-out split of every task family, scored by the family's
verifier, with greedy decoding through the serving engine; retrieval accuracy by context length with DSA on
and, for contrast, with dense attention (the indexer's top-k raised past the context)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import model_config
from kestrel.train.chat_format import prompt_ids
from kestrel.train.data import heldout_examples
from kestrel.train.tasks import verify

ARITHMETIC = ("chain_sum", "basic_arithmetic", "gsm_symbolic", "countdown")


@dataclass(frozen=True)
class EvalConfig:
    model: str
    num_per_family: int = 200
    num_retrieval: int = 50
    retrieval_lengths: tuple[int, ...] = (2048, 8192, 32768)
    families: tuple[str, ...] = ARITHMETIC
    max_new_tokens: int = 256
    seed: int = 0
    device: str = "auto"
    max_running_requests: int = 64
    dense_contrast: bool = True


WRONG_SAMPLES = 3


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of an accuracy of `correct` out of `n` (95% at z = 1.96): what a held-out
    figure is worth. At n = 50 an accuracy of 74% spans 60-84%, so two runs 4 points apart on 50 retrieval
    prompts are not told apart."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / denom
    return (max(0.0, center - half), min(1.0, center + half))


def _accuracy(engine: Engine, examples, max_new_tokens: int, desc: str) -> dict:
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    prompts = {f"{desc}-{i}": prompt_ids(tok, ex) for i, ex in enumerate(examples)}
    limit = engine.plan.max_model_len
    outputs: dict[str, list[int]] = {}
    pending = list(prompts.items())
    bar = tqdm(total=len(prompts), desc=desc, unit="q", leave=False)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(engine.scheduler.waiting) < 256:
            rid, ids = pending.pop(0)
            room = min(max_new_tokens, limit - len(ids))
            if room < 1:
                outputs[rid] = []
                bar.update(1)
                continue
            engine.add_request(
                ids, SamplingParams(temperature=0, max_tokens=room) if room < max_new_tokens else params, rid
            )
            outputs[rid] = []
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                bar.update(1)
    bar.close()
    texts = [tok.decode(outputs[rid]) for rid in prompts]
    correct = [verify(ex, text) for ex, text in zip(examples, texts)]
    wrong = [(ex, text) for ex, text, ok in zip(examples, texts, correct) if not ok]
    return {
        "n": len(examples),
        "accuracy": sum(correct) / max(len(examples), 1),
        "ci95": wilson_interval(sum(correct), len(examples)),
        "seconds": time.perf_counter() - start,
        # what a wrong answer looks like: the first few, to read beside the figure
        "wrong_samples": [{"expected": ex.answer, "got": text} for ex, text in wrong[:WRONG_SAMPLES]],
    }


def evaluate(cfg: EvalConfig, on_progress=None) -> dict:
    """The eval table as a dict; `on_progress(result)` gets the partial result after each family and length
    (so that a run cut short still leaves what it measured)."""
    report = on_progress or (lambda result: None)
    longest = max(cfg.retrieval_lengths, default=0)
    # room for the longest retrieval problem, within the model's own limit (lengths past it are skipped below)
    room = min(max(longest + cfg.max_new_tokens + 512, 4096), model_config(cfg.model).max_position_embeddings)
    engine = Engine(
        EngineConfig(
            model=cfg.model,
            device=cfg.device,
            max_running_requests=cfg.max_running_requests,
            max_model_len=room,
        )
    )
    topk = engine.model.config.index_topk
    result: dict = {"model": cfg.model, "families": {}, "retrieval": {}}
    for family in cfg.families:
        examples = heldout_examples(family, cfg.num_per_family, seed=cfg.seed)
        result["families"][family] = _accuracy(engine, examples, cfg.max_new_tokens, family)
        report(result)
    for length in cfg.retrieval_lengths:
        if length + cfg.max_new_tokens > engine.plan.max_model_len:
            result["retrieval"][length] = {"skipped": f"context limit {engine.plan.max_model_len}"}
            report(result)
            continue
        examples = heldout_examples(
            "retrieval", cfg.num_retrieval, seed=cfg.seed, tokenizer=engine.tokenizer, context_tokens=length
        )
        entry = {}
        modes = [("dsa", False)] + ([("dense", True)] if cfg.dense_contrast and topk else [])
        for name, dense in modes:
            engine.set_dense_attention(dense)
            entry[name] = _accuracy(engine, examples, 32, f"retrieval@{length}-{name}")
            result["retrieval"][length] = entry
            report(result)
        engine.set_dense_attention(False)
    return result


def format_table(result: dict) -> str:
    lines = ["| family | n | accuracy | 95% interval |", "|---|---|---|---|"]

    def row(name: str, r: dict) -> str:
        lo, hi = r.get("ci95") or wilson_interval(round(r["accuracy"] * r["n"]), r["n"])
        return f"| {name} | {r['n']} | {r['accuracy']:.1%} | {lo:.0%}-{hi:.0%} |"

    for family, r in result["families"].items():
        lines.append(row(family, r))
    for length, entry in result["retrieval"].items():
        if "skipped" in entry:
            lines.append(f"| retrieval @{length} | - | skipped ({entry['skipped']}) | |")
            continue
        for mode, r in entry.items():
            lines.append(row(f"retrieval @{length} ({mode})", r))
    return "\n".join(lines)
