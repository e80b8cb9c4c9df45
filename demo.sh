#!/usr/bin/env bash
# The whole pipeline, offline, on a small default: shards from the Python standard library's source, a small GPT
# trained on them, a checkpoint, samples from it and a loss plot. Safe to run twice (finished stages are skipped).
# Usage: bash demo.sh        DEMO_STEPS=N trains longer or shorter; DEMO_DIR=path puts data/ and out/ elsewhere
set -euo pipefail
cd "$(dirname "$0")"
. scripts/env.sh
steps="${DEMO_STEPS:-250}"
root="${DEMO_DIR:-.}"
data="$root/data/stdlib"
out="$root/out/demo"
echo ">> 1/4 data: python fineweb.py --source stdlib --out-dir $data"
python fineweb.py --source stdlib --out-dir "$data"
echo ">> 2/4 train: python train.py --preset demo --data $data --out-dir $out --max-steps $steps --resume auto"
python train.py --preset demo --data "$data" --out-dir "$out" --max-steps "$steps" --resume auto
ckpt=$(ls "$out"/ckpt_*.pt | tail -n 1)
echo ">> 3/4 sample: python sample.py --ckpt $ckpt"
python sample.py --ckpt "$ckpt" --prompt "def " --max-new-tokens 100 --num-samples 2 --top-k 50 --seed 1
echo ">> 4/4 plot: python plot.py --log $out/log.jsonl"
python plot.py --log "$out/log.jsonl"
echo
echo "demo outputs: shards in $data/, checkpoint $ckpt, log $out/log.jsonl, plot $out/loss.png"
