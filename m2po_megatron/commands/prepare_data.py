"""`m2po prepare-data`: DeepScaleR-style problems (and the 8 eval sets) -> the training format."""

from __future__ import annotations

import json
import os
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "prepare-data",
        help="convert DeepScaleR-style JSON/JSONL/parquet (path or HF dataset id) and the eval sets (local, or "
             "fetched with --eval-hub) to the training format (id, prompt, answer, source)",
        description="Writes OUT/train.jsonl (+ .parquet with --parquet), OUT/eval/<name>.jsonl and "
                    "OUT/prepare_report.json. Malformed rows are skipped and reported with line numbers.",
    )
    p.add_argument("--input", help="training data: a .json/.jsonl(.gz)/.parquet file, a directory of them, or a "
                                   "Hugging Face dataset id such as agentica-org/DeepScaleR-Preview-Dataset")
    p.add_argument("--split", default="train", help="split to pick among a HF dataset's files (default train)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--template", default="m2po",
                   help="prompt template: 'm2po' (the paper's), 'plain', or a format string with {problem}")
    p.add_argument("--chat-template", metavar="TOKENIZER",
                   help="apply this tokenizer's chat template (HF id or directory) around the prompt")
    p.add_argument("--seed", type=int, default=42, help="shuffle seed (default 42, as the paper)")
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--no-dedup", action="store_true", help="keep duplicate problems")
    p.add_argument("--problem-key", help="field holding the problem (default: problem/question/prompt)")
    p.add_argument("--answer-key", help="field holding the answer (default: answer/final_answer/ground_truth)")
    p.add_argument("--max-rows", type=int, help="keep at most this many training rows (after shuffling)")
    p.add_argument("--parquet", action="store_true", help="also write .parquet next to each .jsonl")
    p.add_argument("--eval-dir", help="directory with <name>.jsonl eval sets (default: the shipped ones, "
                                      "MATH-500 only; --eval-hub fetches all 8)")
    p.add_argument("--eval-hub", action="store_true",
                   help="fetch the eval sets from where the released M2PO code loads them (HF dataset ids; GaoKao "
                        "from M2PO's repository, sha256-checked) instead of --eval-dir; needs the network or a "
                        "filled HF cache (HF_HUB_OFFLINE=1); see docs/data.md")
    p.add_argument("--eval-sets", default=",".join(_eval_names()),
                   help="comma-separated eval set names to prepare ('' for none)")
    p.add_argument("--max-malformed-fraction", type=float, default=0.5,
                   help="fail when more than this fraction of a file's rows is malformed (wrong file or keys)")
    p.set_defaults(func=handler)


def _eval_names():
    from m2po_megatron.data.prepare import EVAL_SETS

    return list(EVAL_SETS)


def handler(args) -> int:
    from pathlib import Path

    from m2po_megatron.data.prepare import (PrepareReport, find_eval_file, prepare_rows, resolve_input,
                                            resolve_template, shipped_eval_dir)
    from m2po_megatron.data.records import read_records, write_jsonl, write_parquet

    try:
        resolve_template(args.template)
    except ValueError as e:
        print(f"m2po prepare-data: {e}", file=sys.stderr)
        return 2
    if not args.input and not args.eval_sets:
        print("m2po prepare-data: nothing to do: give --input and/or --eval-sets", file=sys.stderr)
        return 2
    tokenizer = None
    if args.chat_template:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.chat_template)
        if not getattr(tokenizer, "chat_template", None):
            print(f"m2po prepare-data: tokenizer {args.chat_template} has no chat template; drop --chat-template",
                  file=sys.stderr)
            return 2
    out = Path(args.out)
    try:  # before any reading: a bad --out fails first and writes nothing elsewhere
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        print(f"m2po prepare-data: --out {args.out}: cannot write there ({e.strerror or e}); give a writable "
              "directory", file=sys.stderr)
        return 2
    if args.eval_dir and args.eval_hub:
        print("m2po prepare-data: --eval-dir and --eval-hub both given; use one source for the eval sets",
              file=sys.stderr)
        return 2
    if args.eval_hub:
        from m2po_megatron.data.hub import BENCHMARKS

        unknown = [n for n in args.eval_sets.split(",") if n and n not in BENCHMARKS]
        if unknown:
            print(f"m2po prepare-data: --eval-hub has no source for {unknown}; known: {', '.join(BENCHMARKS)}; "
                  "give such sets with --eval-dir in a second call", file=sys.stderr)
            return 2
    if args.eval_dir and not Path(args.eval_dir).is_dir():
        print(f"m2po prepare-data: --eval-dir {args.eval_dir}: no such directory; give the directory with the "
              "<name>.jsonl eval sets, or use --eval-hub (all 8 from their sources) or neither (the shipped MATH-500)",
              file=sys.stderr)
        return 2
    summary: dict = {"template": args.template, "chat_template": args.chat_template, "seed": args.seed,
                     "train": None, "eval": {}, "eval_missing": []}
    kw = dict(template=args.template, tokenizer=tokenizer, dedup=not args.no_dedup,
              problem_key=args.problem_key, answer_key=args.answer_key)

    def too_broken(rep, what) -> bool:
        bad = len(rep.malformed)
        if rep.rows_in and bad / rep.rows_in > args.max_malformed_fraction:
            first = rep.malformed[0]
            print(f"m2po prepare-data: {what}: {bad} of {rep.rows_in} rows malformed (first: line {first['line']}: "
                  f"{first['reason']}); wrong file or field names? see --problem-key/--answer-key",
                  file=sys.stderr)
            return True
        return False

    def emit(rows, stem) -> list[str]:
        files = [write_jsonl(rows, out / f"{stem}.jsonl")]
        if args.parquet:
            files.append(write_parquet(rows, out / f"{stem}.parquet"))
        return files

    if args.input:
        try:
            files = resolve_input(args.input, args.split)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"m2po prepare-data: {e}", file=sys.stderr)
            return 2
        report = PrepareReport(source=args.input)
        records = []
        for f in files:
            try:
                recs, rr = read_records(f)
            except (OSError, ValueError, UnicodeDecodeError, ImportError) as e:
                print(f"m2po prepare-data: cannot read {f}: {e}", file=sys.stderr)
                return 2
            records += recs
            report.malformed += [{"file": f, **m} for m in rr.malformed]
            report.rows_in += len(rr.malformed)
        rows, report = prepare_rows(records, _source_name(args.input), seed=None if args.no_shuffle else args.seed,
                                    report=report, **kw)
        if too_broken(report, args.input):
            return 2
        if args.max_rows is not None:
            rows = rows[: args.max_rows]
            report.rows_out = len(rows)
        if not rows:
            print(f"m2po prepare-data: --input {args.input}: no usable rows ({report.rows_in} read, "
                  f"{len(report.malformed)} malformed, {report.duplicates} duplicates); check the file and "
                  "--problem-key/--answer-key", file=sys.stderr)
            return 2
        summary["train"] = {**report.as_dict(), "files": emit(rows, "train")}
        _say(f"train: {report.rows_out} rows ({report.duplicates} duplicates, {len(report.malformed)} malformed "
             f"skipped) from {report.rows_in}")
    eval_dir = Path(args.eval_dir) if args.eval_dir else shipped_eval_dir()
    for name in [n for n in args.eval_sets.split(",") if n]:
        if args.eval_hub:
            from m2po_megatron.data.hub import BENCHMARKS, HubError, fetch_benchmark
            from m2po_megatron.data.records import ReadReport

            f = BENCHMARKS[name].source
            try:
                recs, rr = list(enumerate(fetch_benchmark(name), 1)), ReadReport(f)
            except HubError as e:
                print(f"m2po prepare-data: {e}", file=sys.stderr)
                return 2
        else:
            f = find_eval_file(eval_dir, name)
            if f is None:
                summary["eval_missing"].append(name)
                _say(f"eval {name}: not found in {eval_dir} (skipped)")
                continue
            try:
                recs, rr = read_records(f)
            except (OSError, ValueError, UnicodeDecodeError, ImportError) as e:
                print(f"m2po prepare-data: cannot read eval set {f}: {e}", file=sys.stderr)
                return 2
        rep = PrepareReport(source=name, malformed=list(rr.malformed))
        rep.rows_in = len(rr.malformed)
        # eval sets keep their order and ids; duplicates are kept (a benchmark is what it is)
        # hub rows are already normalised to problem/answer, whatever --problem-key says for the training file
        keys = {"problem_key": "problem", "answer_key": "answer"} if args.eval_hub else {}
        rows, rep = prepare_rows(recs, name, seed=None, report=rep, **{**kw, "dedup": False, **keys})
        if too_broken(rep, str(f)):
            return 2
        if not rows:
            print(f"m2po prepare-data: eval set {f}: no usable rows", file=sys.stderr)
            return 2
        summary["eval"][name] = {**rep.as_dict(), "files": emit(rows, f"eval/{name}"), "from": str(f)}
        _say(f"eval {name}: {rep.rows_out} rows ({len(rep.malformed)} malformed skipped)")
    wanted = [n for n in args.eval_sets.split(",") if n]
    if wanted and len(summary["eval_missing"]) == len(wanted):
        print(f"m2po prepare-data: none of the eval sets {wanted} is in {eval_dir}; check --eval-dir/--eval-sets "
              "(or --eval-sets '' for none)", file=sys.stderr)
        return 2
    (out / "prepare_report.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    _say(f"wrote {out}/prepare_report.json")
    return 0


def _source_name(spec: str) -> str:
    from pathlib import Path

    p = Path(spec)
    if p.exists():
        name = p.name
        for suf in (".gz", ".jsonl", ".json", ".parquet"):
            name = name.removesuffix(suf)
        return name
    return spec


def _say(msg: str) -> None:
    print(f"prepare-data: {msg}", file=sys.stderr)
