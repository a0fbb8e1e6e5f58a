"""`osd draft derive | heal | build | widen | cost`: the cheap derived draft (models/derived.py, distill/heal.py).
Parse -> config -> call the library."""
from __future__ import annotations

import json

from osd.flags import add_config_flags, config_from


def register(sub) -> None:
    from osd.config import ModelConfig
    from osd.distill.heal import HealConfig
    from osd.models.derived import DeriveConfig

    draft = sub.add_parser("draft", help="the cheap derived draft: cut it from the bundled 0.5B, heal it by distillation")
    verbs = draft.add_subparsers(dest="draft_command", required=True)

    def target_flags(p):
        p.add_argument("--target", default=ModelConfig.target, help="the teacher, as it serves (a GGUF runs on llama.cpp)")
        p.add_argument("--threads", type=int, default=0, help="torch and llama.cpp threads (0 = default)")
        p.add_argument("--cache-dir", default=None, help="teacher cache root (default $OSD_CACHE/teacher-heal)")
        p.add_argument("--teacher-backend", default="auto", choices=["auto", "llama.cpp", "osd", "torch"],
                       help="the target's runner (auto: a GGUF on osd's Q4 kernel where it runs the file, else llama.cpp); "
                       "on the Q4 kernel, "
                       "--teacher-slots target answers decode at once (bitwise as alone; ~3x the tokens/s)")
        p.add_argument("--teacher-slots", type=int, default=8, help="target answers decoded together (osd backend)")

    p = verbs.add_parser("derive", help="cut a derived draft (kept layers + vocabulary map) into --out; untrained")
    p.add_argument("--out", required=True, help="directory of the derived draft (serve it with --draft derived:<out>)")
    add_config_flags(p, DeriveConfig)
    p.set_defaults(func=cmd_derive)

    p = verbs.add_parser("heal", help="distil the target into a derived draft directory (resumable: rerun to continue)")
    p.add_argument("--draft", required=True, help="directory made by `osd draft derive`; the healed delta is written there")
    target_flags(p)
    add_config_flags(p, HealConfig)
    p.set_defaults(func=cmd_heal)

    p = verbs.add_parser("build", help="derive + heal in one command (resumable: rerun the same command to continue)")
    p.add_argument("--out", required=True, help="directory of the derived draft (serve it with --draft derived:<out>)")
    target_flags(p)
    add_config_flags(p, DeriveConfig)
    add_config_flags(p, HealConfig)
    p.set_defaults(func=cmd_build)

    p = verbs.add_parser("widen", help="a derived draft with a wider head: its map plus the tokens other traffic uses "
                         "(e.g. other languages); trained rows kept, new rows from the base's head")
    p.add_argument("--draft", default="derived:cheap-0.5b", help="the derived draft to widen (left as it is)")
    p.add_argument("--sources", required=True, help="texts to count, comma list of name[@lang][:split][[start:end]], "
                   "e.g. 'multilingual_qa@de:test[600:],multilingual_qa@zh:test[600:]' (records a replay does not "
                   "stream)")
    p.add_argument("--add", type=int, default=8192, help="at most this many new head rows, most counted first")
    p.add_argument("--out", required=True, help="directory of the wider draft (serve it with --draft derived:<out>)")
    p.set_defaults(func=cmd_widen)

    p = verbs.add_parser("cost", help="seconds per draft token of derived shapes (int8 serving copy) vs the target's")
    p.add_argument("--base", default=DeriveConfig.base)
    p.add_argument("--layer-counts", default="2,4,6,8", help="kept layers per shape: first half + last half")
    p.add_argument("--vocabs", default="8192,16384,32768", help="LM head rows per shape")
    p.add_argument("--target", default=ModelConfig.target, help="measured in the same run for c ('' = skip)")
    p.add_argument("--threads", type=int, default=0, help="torch and llama.cpp threads (0 = default)")
    p.add_argument("--quantize", default="int8", help="serving copy: int8 | none")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu = this thread's CPU time (use with "
                   "--threads 1 on a busy machine)")
    p.add_argument("--runners", default="glue", help="draft runners to time, comma list: glue (the one the engine "
                   "uses where the copy qualifies, models/glue_draft.py), transformers (the reference forward)")
    p.add_argument("--out", default="benchmarks/draft-cost.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="append a summary here ('' = no)")
    p.set_defaults(func=cmd_cost)


def _progress():
    from tqdm import tqdm

    return tqdm


def cmd_derive(args) -> None:
    from osd.models.derived import DeriveConfig, build_derived, save_derived

    model, recipe = build_derived(config_from(args, DeriveConfig))
    save_derived(args.out, model, recipe)
    print(json.dumps({"draft": f"derived:{args.out}", **recipe}, indent=2))


def _heal(args, out: str, derive) -> None:
    from osd.build import set_threads
    from osd.distill.heal import HealConfig, run_heal

    set_threads(args.threads)
    metrics = run_heal(out, config_from(args, HealConfig), args.target, derive, args.threads, args.cache_dir, _progress(),
                       teacher_backend=args.teacher_backend, teacher_slots=args.teacher_slots)
    print(json.dumps({"draft": f"derived:{out}", **metrics}, indent=2, default=str))


def cmd_heal(args) -> None:
    _heal(args, args.draft, None)


def cmd_build(args) -> None:
    from osd.models.derived import DeriveConfig

    _heal(args, args.out, config_from(args, DeriveConfig))


def cmd_widen(args) -> None:
    from osd.models.derived import read_recipe, widen_derived

    out = widen_derived(args.draft, args.out, args.sources, args.add)
    print(json.dumps({"draft": f"derived:{out}", "widened": read_recipe(str(out))["widened"][-1]}, indent=2))


def cmd_cost(args) -> None:
    from osd.distill.draft_cost import run_draft_cost
    from osd.records import table
    from osd.records import emit_report, machine, redacted_command, write_result
    from osd.build import set_threads
    from osd.distill.heal import open_target

    import sys

    set_threads(args.threads)
    target = open_target(args.target, args.threads) if args.target else None
    result = run_draft_cost(args.base, target, [int(x) for x in args.layer_counts.split(",")],
                            [int(x) for x in args.vocabs.split(",")], args.quantize, repeats=args.repeats,
                            clock=args.clock, progress=_progress(), runners=tuple(args.runners.split(",")))
    path = write_result(result, args.out)
    rows = [[r["layers"], ",".join(map(str, r["layer_ids"])), r["vocab"], r["runner"], r["t_draft_ms"],
             r["t_draft_median_ms"], r["c"]] for r in result["rows"]]
    t = table(rows, ["layers", "kept", "head rows", "draft runner", "ms/token (min)", "ms/token (median)",
                     "c = draft/target"])
    note = (f"target {args.target}: {result['t_target_ms']:.1f} ms/token (median {result['t_target_median_ms']:.1f})"
            if result["t_target_ms"] else "no target measured")
    m = machine()
    emit_report("Derived draft cost (`osd draft cost`)",
                f"`{redacted_command(sys.argv[1:])}`; clock {args.clock}, serving copy {args.quantize}; machine: "
                f"{m['cpu']} ({m.get('cpu_flags')}), {m['cores']} cores", [t, note], path, args.markdown)
