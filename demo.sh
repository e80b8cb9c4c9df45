#!/usr/bin/env bash
# The whole pipeline on a small default: token shards, a small GPT trained on them, a checkpoint, samples from it and
# a loss plot. Offline by default (the docstrings of the Python standard library are the corpus). Safe to run twice:
# finished stages are skipped and a finished run is resumed, not redone (a DEMO_STEPS below the finished run's is
# refused by train.py: delete out/demo, or pick another DEMO_DIR).
#
# Usage: bash demo.sh                                    # stdlib docstrings, offline
#        bash demo.sh --source stdlib                    # the stdlib's code itself (indentation: harder to learn)
#        bash demo.sh --source shakespeare               # Tiny Shakespeare (downloaded once)
#        bash demo.sh --shakespeare-path FILE            # the same, from a local copy (offline)
#        bash demo.sh --source path/to/corpus.txt        # any local .txt/.jsonl/.parquet file (.gz too), dir or glob
#        bash demo.sh --source fineweb                   # the first 20M tokens of fineweb-edu sample-10BT (network)
# Environment: DEMO_STEPS=N trains longer or shorter (default 900); DEMO_DIR=path puts data/ and out/ elsewhere;
# DEMO_PROMPT sets the sample prompt.
set -euo pipefail
cd "$(dirname "$0")"
source="stdlib-docs"
local_copy=()
while [ $# -gt 0 ]; do
    case "$1" in
        --source) source="${2:?--source needs a value}"; shift 2 ;;
        --source=*) source="${1#*=}"; shift ;;
        # fineweb.py's Tiny Shakespeare (its val split, its names), not a generic local text file
        --shakespeare-path) source=shakespeare; local_copy=(--shakespeare-path "${2:?--shakespeare-path needs a file}"); shift 2 ;;
        --shakespeare-path=*) source=shakespeare; local_copy=(--shakespeare-path "${1#*=}"); shift ;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1 (demo.sh takes --source NAME_OR_PATH or --shakespeare-path FILE; see bash demo.sh --help)" >&2; exit 2 ;;
    esac
done
. scripts/env.sh
steps="${DEMO_STEPS:-900}"
root="${DEMO_DIR:-.}"
prepare=(--source "$source")
case "$source" in
    stdlib|stdlib-docs) name="${source/-/_}" ;;
    shakespeare) name=shakespeare; prepare+=(${local_copy[@]+"${local_copy[@]}"}) ;;
    fineweb) name=fineweb_demo  # fineweb.py's default source is fineweb-edu sample-10BT; a demo needs 20M tokens
             prepare=(--max-tokens 20000000 --shard-size 10000000 --val-tokens 1000000) ;;
    *) name=$(basename "${source%%[*?]*}"); name="${name%%.*}"; name="${name:-local}" ;;
esac
case "$source" in
    stdlib) prompt="def " ;;
    stdlib-docs) prompt="Return the" ;;
    *shakespeare*) prompt="ROMEO:" ;;
    *) prompt="The" ;;
esac
prompt="${DEMO_PROMPT:-$prompt}"
data="$root/data/$name"
out="$root/out/demo"
[ "$name" = stdlib_docs ] || out="$root/out/demo_$name"
echo ">> 1/4 data: python fineweb.py ${prepare[*]} --out-dir $data"
python fineweb.py "${prepare[@]}" --out-dir "$data"
echo ">> 2/4 train: python train.py --preset demo --data $data --out-dir $out --max-steps $steps --resume auto"
python train.py --preset demo --data "$data" --out-dir "$out" --max-steps "$steps" --resume auto \
    --sample-prompt "$prompt"
ckpt=$(ls -t "$out"/ckpt_*.pt | head -n 1)
echo ">> 3/4 sample: python sample.py --ckpt $ckpt --prompt '$prompt' --temperature 1 --corpus $data"
python sample.py --ckpt "$ckpt" --prompt "$prompt" --max-new-tokens 100 --num-samples 4 --temperature 1 --top-k 50 \
    --seed 1 --corpus "$data" | tee "$out/samples.txt"
echo ">> 4/4 plot: python plot.py --log $out/log.jsonl"
python plot.py --log "$out/log.jsonl"
echo
python - "$out/log.jsonl" <<'PY'
import sys
from common import iter_log
last = [r for r in iter_log(sys.argv[1]) if r["type"] == "val"][-1]
print(f"val loss {last['val_loss']:.4f} nats a token, {last['val_bpb']:.4f} bits per byte (step {last['step']})")
PY
echo "demo outputs: shards in $data/, checkpoint $ckpt, log $out/log.jsonl, samples $out/samples.txt, plot $out/loss.png"
