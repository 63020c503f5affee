#!/usr/bin/env bash
# The LoRA demo end to end: validation loss of the base, train the adapter (recipes/lora/shanty.toml), validation
# loss with it, a merged checkpoint, and a sample from the base with the adapter.
#   bash recipes/lora/run.sh OUT_DIR [extra --set overrides for kimik3 train ...]
set -euo pipefail
out=${1:?usage: run.sh OUT_DIR [--set KEY=VALUE ...]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
recipe=recipes/lora/shanty.toml
base=src/kimik3/demo/k3-shakespeare
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python3 recipes/lora/evaluate.py "$recipe" > "$out/eval_before.json"
start=$(date +%s)
python3 -m kimik3 train "$recipe" --set "out_dir=\"$out/run\"" "$@"
echo "train wall time: $(( $(date +%s) - start )) s" | tee "$out/train_time.txt"
adapter=$(ls -d "$out"/run/checkpoints/step-* | sort | tail -1)/adapter
python3 recipes/lora/evaluate.py "$recipe" --adapter "$adapter" > "$out/eval_after.json"
python3 -m kimik3 lora merge "$base" "$adapter" "$out/merged" --experts mxfp4 --quiet
python3 -m kimik3 generate --lora "$adapter" --prompt "CAPTAIN:" --max-new-tokens 60 --seed 0 > "$out/sample.txt"
cat "$out/eval_before.json" "$out/eval_after.json"
echo "serve it beside the base: python3 -m kimik3 serve --lora shanty=$adapter   (then \"model\": \"shanty\")"
