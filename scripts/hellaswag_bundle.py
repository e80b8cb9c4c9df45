"""A CORE bundle of HellaSwag alone, from a local HellaSwag jsonl (or .jsonl.gz), for core.py --bundle offline.

DCLM's two HellaSwag tasks: hellaswag_zeroshot (0-shot) and hellaswag (10-shot), multiple choice, random baseline 25%.
Each row is {"query", "choices", "gold"} as in DCLM's hellaswag.jsonl: the query is `activity_label: ctx_a Ctx_b`,
query and endings cleaned as the Eleuther harness cleans them ([title] markers and double spaces out).

Usage:
    python scripts/hellaswag_bundle.py ../shared/data/hellaswag_val_subset1000.jsonl.gz data/hellaswag_bundle
    python core.py --ckpt out/demo/ckpt_000900.pt --bundle data/hellaswag_bundle --max-per-task 100
"""

import gzip
import json
import re
import sys
from pathlib import Path

TASKS = (("hellaswag_zeroshot", 0), ("hellaswag", 10))  # DCLM's core.yaml labels and shots


def clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def row(example: dict) -> dict:
    ctx = f"{example['ctx_a']} {example['ctx_b'].capitalize()}"
    return {"query": clean(f"{example['activity_label']}: {ctx}"), "choices": [clean(e) for e in example["endings"]],
            "gold": int(example["label"])}


def main(source: str, out: str) -> None:
    opener = gzip.open if source.endswith(".gz") else open
    with opener(source, "rt", encoding="utf-8") as f:
        rows = [row(json.loads(line)) for line in f if line.strip()]
    data = Path(out) / "eval_data" / "language_understanding"
    data.mkdir(parents=True, exist_ok=True)
    (data / "hellaswag.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (Path(out) / "core.yaml").write_text("icl_tasks:\n" + "".join(
        f"- label: {label}\n  dataset_uri: language_understanding/hellaswag.jsonl\n  num_fewshot: [{shots}]\n"
        "  icl_task_type: multiple_choice\n" for label, shots in TASKS))
    (Path(out) / "eval_meta_data.csv").write_text("Eval Task,Task Category,Random baseline\n" + "".join(
        f"{label},language understanding,25.0\n" for label, _ in TASKS))
    print(f"{out}: {len(rows)} HellaSwag rows as DCLM's {' and '.join(label for label, _ in TASKS)}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python scripts/hellaswag_bundle.py HELLASWAG_JSONL[.gz] OUT_DIR")
    main(*sys.argv[1:])
