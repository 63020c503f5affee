"""`kimik3 eval --model PATH --tasks NAMES [--include-path DIR] [--limit N] [--num-fewshot N] [--batch-size N]
[engine flags] [--output-path FILE]`: lm-eval tasks in process on kimik3's engine (needs the `eval` extra); prints
lm-eval's table."""

from __future__ import annotations

from kimik3.cli.engine_args import add_engine_args


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="lm-eval benchmarks in process (loglikelihood, rolling, generate_until)")
    p.add_argument("--model", default=None,
                   help="checkpoint folder or Hugging Face Hub id org/name (default: the bundled demo model)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default: main)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    p.add_argument("--include-path", default=None, help="a folder of task YAML files (your own tasks)")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="compute dtype (default: float32 on the CPU, the checkpoint's on CUDA)")
    p.add_argument("--output-path", default=None, help="write lm-eval's results as JSON to this file")
    p.add_argument("--log-samples", action="store_true", help="keep every document's inputs and outputs in the JSON")
    # lm-eval's name for the sequences run at once is --batch-size: here the same flag as --max-num-seqs
    add_engine_args(p, max_num_seqs="8", seqs_alias="--batch-size")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        from lm_eval.utils import make_table

        from kimik3.hf.harness import evaluate
    except ImportError as e:
        raise ValueError(f"kimik3 eval needs the eval extra (pip install 'kimik3[eval]'): {e}") from None
    from kimik3.checkpoint.source import read_config as model_config
    from kimik3.cli.common import model_path
    from kimik3.cli.engine_args import engine_config
    from kimik3.inference.engine import EngineConfig

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks: name at least one lm-eval task")
    path = model_path(args)
    positions = model_config(path).text.max_position_embeddings
    config = engine_config(args, EngineConfig(max_num_seqs=8), positions)
    results = evaluate(str(path), tasks, include_path=args.include_path, limit=args.limit,
                       num_fewshot=args.num_fewshot, device=args.device, dtype=args.dtype,
                       output_path=args.output_path, log_samples=args.log_samples, config=config)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0
