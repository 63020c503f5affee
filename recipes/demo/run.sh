#!/usr/bin/env bash
# The demo model end to end: train (configs/train/demo.toml), convert the last checkpoint to the shipped
# MXFP4 layout, score it (recipes/demo/evaluate.py) and train the dense baseline (recipes/demo/baseline.py).
#   make demo-data && bash recipes/demo/run.sh OUT_DIR [extra --set overrides for kimik3 train ...]
# Writes OUT_DIR/{metrics.jsonl, ship/, eval.json, baseline.json}; ship/ is what src/kimik3/demo/k3-shakespeare
# holds. Runs from any directory (the recipe's paths are the repository's).
set -euo pipefail
out=${1:?usage: run.sh OUT_DIR [--set KEY=VALUE ...]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
recipe=configs/train/demo.toml
shipped=src/kimik3/demo/k3-shakespeare
python3 -m kimik3 train "$recipe" --set "out_dir=\"$out/run\"" "$@"
last=$(ls -d "$out"/run/checkpoints/step-* | sort | tail -1)
rm -rf "$out/ship"
python3 -m kimik3 convert "$last/model" "$out/ship" --experts mxfp4 --dtype bfloat16 --max-shard-size 15MB --quiet
cp "$shipped/tiktoken.model" "$out/ship/"
cp "$out/run/metrics.jsonl" "$out/metrics.jsonl"
python3 recipes/demo/evaluate.py --trained "$last/model" --model "$out/ship" --out "$out/eval.json"
python3 recipes/demo/baseline.py --recipe "$recipe" --out "$out/baseline.json" "$@"
