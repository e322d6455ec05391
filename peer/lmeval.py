"""lm-evaluation-harness through ``specexpert serve``'s completions endpoint, per mode.

    python peer/lmeval.py [--modes vanilla fetch ...] [--budget 0.25]

Two local tasks on the embedded model's held-out code (``heldout/test.txt``: whole files
of the corpus's package-level test split, never trained on):

- ``specexpert_code_ppl``: rolling log-likelihood of every file (lm-eval's
  ``loglikelihood_rolling``, windows of the model's 1024 tokens): word and byte
  perplexity, bits per byte. The server scores prompt tokens (``echo`` + ``logprobs``),
  which vLLM computes in prefill, where every miss policy fetches (exactly) except for a
  prompt chunk of one token, which vLLM's split counts as decode: this task checks
  prefill, and can barely see what a mode does to decode.
- ``specexpert_code_rest_of_line``: greedy completion of the rest of a line of code
  after the file up to the middle of that line (``generate_until`` "\\n"; exact match
  and chrF), which runs decode steps, where the approximate miss policies act.

Each mode starts the server once (127.0.0.1), runs both tasks with lm-eval's
``local-completions`` model, and stops it. Writes ``benchmarks/results/lmeval.json``,
prints a table, and exits 1 if ``fetch`` (exact) differs from vanilla in any number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_specexpert.tools.server import serving

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "vllm_specexpert" / "assets"
MODEL = ASSETS / "tiny-qwen3-moe"
CALIBRATION = str(ASSETS / "tiny-qwen3-moe-calibration")
WORK = REPO / ".peer-cache" / "lmeval"
EOS = "<|endoftext|>"

# The plugin's modes at --budget; vanilla is vLLM without the plugin. "exact" modes must
# give vanilla's numbers.
MODES = {
    "vanilla": None,
    "fetch": {"miss_policy": "fetch", "predictor": "quasi_hidden", "calibration": CALIBRATION},
    "cpu": {"miss_policy": "cpu"},
    "speculate": {
        "miss_policy": "speculate",
        "predictor": "quasi_hidden",
        "calibration": CALIBRATION,
    },
    "buddy": {"miss_policy": "buddy", "calibration": CALIBRATION},
    "drop": {"miss_policy": "drop"},
}
EXACT = ("vanilla", "fetch")

PPL_TASK = """\
task: specexpert_code_ppl
dataset_path: json
dataset_kwargs:
  data_files: {files}
test_split: train
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""
REST_OF_LINE_TASK = """\
task: specexpert_code_rest_of_line
dataset_path: json
dataset_kwargs:
  data_files: {lines}
test_split: train
output_type: generate_until
doc_to_text: "{{{{prefix}}}}"
doc_to_target: "{{{{rest}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 32
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: chrf
metadata:
  version: 1.0
"""


def write_tasks(prefix_chars: int = 1200, every: int = 20) -> Path:
    """The held-out files as documents, and rest-of-line items every ``every`` lines: the
    file up to the last space before the middle of a line, then the rest of that line.
    (Cutting inside a line, before a space, keeps the prompt's last token an ordinary one:
    a prompt ending in a bare newline is one this tokenizer never shows the model, since
    it merges a newline with the next line's indentation.)"""
    files = [
        text for text in (MODEL / "heldout" / "test.txt").read_text().split(EOS) if text.strip()
    ]
    items = []
    for text in files:
        lines = text.split("\n")
        for index in range(every, len(lines), every):
            line = lines[index]
            indent = len(line) - len(line.lstrip())
            cut = line.rfind(" ", indent, indent + (len(line) - indent) // 2)
            if cut <= indent or len(line) - cut < 4:
                continue
            prefix = "\n".join([*lines[:index], line[:cut]])[-prefix_chars:]
            items.append({"prefix": prefix, "rest": line[cut:]})
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "files.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in files))
    (WORK / "lines.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (WORK / "code_ppl.yaml").write_text(PPL_TASK.format(files=WORK / "files.jsonl"))
    (WORK / "code_rest_of_line.yaml").write_text(
        REST_OF_LINE_TASK.format(lines=WORK / "lines.jsonl")
    )
    print(f"{len(files)} held-out files, {len(items)} rest-of-line items")
    return WORK


def evaluate(port: int, tasks_dir: Path, limit: int | None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = (
        f"model=tiny-qwen3-moe,base_url=http://127.0.0.1:{port}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={MODEL},max_length=1024,"
        # One request at a time: vLLM's numerics depend on what shares a
        # batch, so concurrent requests would make two runs of one mode differ.
        "num_concurrent=1,max_retries=1,timeout=600"
    )
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["specexpert_code_ppl", "specexpert_code_rest_of_line"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        limit=limit,
        log_samples=False,
    )
    results = out["results"]
    ppl, lines = results["specexpert_code_ppl"], results["specexpert_code_rest_of_line"]
    return {
        "word_perplexity": ppl["word_perplexity,none"],
        "byte_perplexity": ppl["byte_perplexity,none"],
        "bits_per_byte": ppl["bits_per_byte,none"],
        "rest_of_line_exact_match": float(lines["exact_match,none"]),
        "rest_of_line_chrf": float(lines["chrf,none"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--port", type=int, default=8461)
    parser.add_argument("--limit", type=int, default=None, help="documents per task (a smoke run)")
    args = parser.parse_args()

    tasks_dir = write_tasks()
    results = {}
    for mode in args.modes:
        config = None if MODES[mode] is None else {"budget": args.budget, **MODES[mode]}
        log = WORK / f"server-{mode}.log"
        print(f"\n=== {mode}: {json.dumps(config)}", flush=True)
        with serving(
            MODEL,
            args.port,
            log,
            config,
            ["--max-model-len", "1024", "--served-model-name", "tiny-qwen3-moe"],
        ):
            started = time.monotonic()
            results[mode] = evaluate(args.port, tasks_dir, args.limit)
            results[mode]["minutes"] = round((time.monotonic() - started) / 60, 1)
        print(mode, results[mode], flush=True)

    print(
        f"\n{'mode':10s} {'word ppl':>12s} {'byte ppl':>10s} {'bits/byte':>10s} "
        f"{'rest EM':>13s} {'chrF':>7s}"
    )
    for mode, r in results.items():
        print(
            f"{mode:10s} {r['word_perplexity']:12.6f} {r['byte_perplexity']:10.6f} "
            f"{r['bits_per_byte']:10.6f} {r['rest_of_line_exact_match']:13.4f} "
            f"{r['rest_of_line_chrf']:7.2f}"
        )
    command = "python peer/lmeval.py " + " ".join(sys.argv[1:])
    out = REPO / "benchmarks" / "results" / "lmeval.json"
    out.write_text(
        json.dumps(
            {
                "command": command.strip(),
                "budget": args.budget,
                "modes": {m: MODES[m] for m in args.modes},
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}\n{command}")
    metrics = (
        "word_perplexity",
        "byte_perplexity",
        "bits_per_byte",
        "rest_of_line_exact_match",
        "rest_of_line_chrf",
    )
    exact = [m for m in EXACT if m in results]
    if len({tuple(results[m][k] for k in metrics) for m in exact}) > 1:
        print(f"FAIL: the exact modes {exact} differ")
        sys.exit(1)


if __name__ == "__main__":
    main()
