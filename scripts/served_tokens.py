"""The shipped model served greedily, one request at a time, against the tokens it gave on the H200 in session 39.

    python3 scripts/served_tokens.py [--device cuda] [--out served_tokens.json]

Each prompt of the reference (bench/results/2026-12-04-h200-session39-greedy-tokens.json) goes through `LLM.chat`
alone, so every decode step is batch 1 (on CUDA: the decode graphs, the one-launch MoE, the GEMVs), greedy, with
the reference's token limit. The run passes when every prompt gives the reference's tokens exactly; the exit
status is 1 otherwise, and the JSON says which prompt differed and where. On the CPU (the reference paths) the same
tokens come back, which tests/test_served_tokens.py checks in CI; on the GPU the script is the end-to-end check of a
changed kernel beside its op tests."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "bench/results/2026-12-04-h200-session39-greedy-tokens.json"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default=None, help="cuda or cpu (default: the engine's, cuda where there is one)"
    )
    parser.add_argument("--model", default=str(ROOT / "kestrel/data/kestrel-demo"))
    parser.add_argument("--reference", default=str(REFERENCE))
    parser.add_argument("--out", default=None, help="write the outputs and the comparison here (JSON)")
    parser.add_argument(
        "--cuda-graph-short-len",
        type=int,
        default=None,
        help="decode graphs this many tokens wide beside the limit's (default: the engine's)",
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from kestrel.engine.llm import LLM
    from kestrel.engine.sampling_params import SamplingParams

    reference = json.loads(Path(args.reference).read_text())
    engine_args = {"max_running_requests": 1} | ({"device": args.device} if args.device else {})
    if args.cuda_graph_short_len is not None:
        engine_args["cuda_graph_short_len"] = args.cuda_graph_short_len
    llm = LLM(args.model, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=reference["max_tokens"])
    start = time.perf_counter()
    outputs = []
    for want in reference["outputs"]:
        chat = [{"role": "user", "content": want["prompt"]}]
        got = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
        tokens = list(got.token_ids)
        differs_at = first_difference(tokens, want["tokens"])
        outputs.append(
            {"prompt": want["prompt"], "tokens": tokens, "text": got.text, "differs_at": differs_at}
        )
        mark = "same" if differs_at is None else f"DIFFERS at token {differs_at}"
        print(f"{mark:>20}  {want['prompt'][:60]!r} -> {got.text[-40:]!r}", flush=True)
    same = sum(o["differs_at"] is None for o in outputs)
    from kestrel.ops.moe.triton_decode import barrier_gave_up

    gave_up = barrier_gave_up(llm.engine.device)  # the one-launch MoE's grid barrier: its results were wrong
    page = llm.engine.config.page_size
    result = {
        "device": str(llm.engine.device),
        # the decode graphs' widths in tokens (none without CUDA graphs): which graphs these tokens came through
        "graph_widths": sorted({width * page for width, _ in llm.engine.runner.graphs}),
        "moe_barrier_gave_up": gave_up,
        "reference": Path(args.reference).name,
        "seconds": time.perf_counter() - start,
        "same": same,
        "prompts": len(outputs),
        "outputs": outputs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"served tokens: {same} of {len(outputs)} prompts the same as {result['reference']}")
    if gave_up:
        print("the one-launch MoE's grid barrier gave up during the run (a grid not all resident)")
    return 0 if same == len(outputs) and not gave_up else 1


if __name__ == "__main__":
    sys.exit(main())
