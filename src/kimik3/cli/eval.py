"""`kimik3 eval --model PATH --tasks NAMES [--include-path DIR] [--limit N] [--num-fewshot N] [--batch-size N]
[--output-path FILE]`: lm-eval tasks in process on kimik3's engine (needs the `eval` extra); prints lm-eval's table."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="lm-eval benchmarks in process (loglikelihood, rolling, generate_until)")
    p.add_argument("--model", default=None,
                   help="checkpoint folder or Hugging Face Hub id org/name (default: the bundled demo model)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default: main)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    p.add_argument("--include-path", default=None, help="a folder of task YAML files (your own tasks)")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences the engine runs at once")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="compute dtype (default: float32 on the CPU, the checkpoint's on CUDA)")
    p.add_argument("--output-path", default=None, help="write lm-eval's results as JSON to this file")
    p.add_argument("--log-samples", action="store_true", help="keep every document's inputs and outputs in the JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        from lm_eval.utils import make_table

        from kimik3.hf.harness import evaluate
    except ImportError as e:
        raise ValueError(f"kimik3 eval needs the eval extra (pip install 'kimik3[eval]'): {e}") from None
    from kimik3.cli.common import model_path

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks: name at least one lm-eval task")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    results = evaluate(str(model_path(args)), tasks, include_path=args.include_path, limit=args.limit,
                       num_fewshot=args.num_fewshot, batch_size=args.batch_size, device=args.device,
                       dtype=args.dtype, output_path=args.output_path, log_samples=args.log_samples)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0
