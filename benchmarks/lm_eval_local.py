"""lm-evaluation-harness through `phasewise serve`, against lm-eval's own `hf` model on the same GGUF.

    make lm-eval          # creates .venv-lm-eval (lm-eval, transformers, torch) once, then runs this
    .venv/bin/python benchmarks/lm_eval_local.py --lm-eval .venv-lm-eval/bin/lm_eval [--dtype fp32 --kv-dtype model]

Two small tasks defined here on local JSON files (benchmarks/data/lm_eval/; nothing comes from a hub):
- facts_mc: 40 multiple-choice questions scored by loglikelihood (lm-eval sends each context +
  continuation as token ids with echo, logprobs 1 and max_tokens 1, and reads the prompt's logprobs);
- facts_gen: 16 short completions, greedy until a newline or a full stop, first word exact match.
lm-eval runs them twice: `local-completions` against phasewise serve (its tokenizer read from the
server: /tokenizer_info, /tokenize, /detokenize) and `hf` on the GGUF, which transformers dequantizes
to fp32. Prints both scores and how many examples they differ by.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serving  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
TASKS = {
    "phasewise_facts_mc": f"""task: phasewise_facts_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / "facts_mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "phasewise_facts_gen": f"""task: phasewise_facts_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / "facts_gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)"
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
""",
}
METRICS = {"phasewise_facts_mc": "acc,none", "phasewise_facts_gen": "exact_match,first_word"}
SIZES = {"phasewise_facts_mc": 40, "phasewise_facts_gen": 16}


def run_lm_eval(lm_eval: str, model: str, model_args: str, tasks_dir: Path, out: Path, extra: list[str]) -> dict:
    """One lm_eval run over both tasks: {task: score}."""
    cmd = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS),
           "--include_path", str(tasks_dir), "--output_path", str(out), *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval --model {model} failed:\n{done.stderr[-3000:]}")
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    print(f"  lm_eval --model {model}: {time.perf_counter() - started:.0f} s", flush=True)
    return {t: results["results"][t][m] for t, m in METRICS.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default=".venv-lm-eval/bin/lm_eval", help="the lm_eval command (make lm-eval)")
    ap.add_argument("--dtype", default="auto", help="phasewise serve's weights (default: its own choice)")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from phasewise.loading.loader import default_model_path

    path = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        tasks_dir = Path(tmp) / "tasks"
        tasks_dir.mkdir()
        for name, text in TASKS.items():
            (tasks_dir / f"{name}.yaml").write_text(text)
        port = serving.free_port()
        cmd = [sys.executable, "-m", "phasewise.cli", "serve", "--port", str(port),
               *(["--quantization", args.dtype] if args.dtype in ("int8", "q4") else ["--dtype", args.dtype]),
               "--kv-dtype", args.kv_dtype, "--threads", str(args.threads), "--no-access-log"]
        log = Path(tmp) / "server.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                serving.wait_ready(url, proc)
            except RuntimeError as e:
                raise SystemExit(f"{e}:\n{log.read_text()[-1500:]}") from None
            served = run_lm_eval(args.lm_eval, "local-completions",
                                 f"model={path.stem},base_url={url}/v1/completions,tokenizer_backend=remote,"
                                 "num_concurrent=4,max_retries=1", tasks_dir, Path(tmp) / "served", [])
        finally:
            proc.terminate()
            proc.wait(30)
        print(f"  phasewise serve: {log.read_text().splitlines()[0]}")
        hf = run_lm_eval(args.lm_eval, "hf", f"pretrained={path.parent},gguf_file={path.name},dtype=float32",
                         tasks_dir, Path(tmp) / "hf", ["--device", "cpu", "--batch_size", "8"])
    print(f"\n{'task':24}{'phasewise serve':>17}{'hf (fp32)':>11}{'examples apart':>16}")
    for task in TASKS:
        apart = round(abs(served[task] - hf[task]) * SIZES[task])
        print(f"{task:24}{served[task]:17.3f}{hf[task]:11.3f}{apart:16d}")


if __name__ == "__main__":
    main()
