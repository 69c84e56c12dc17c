#!/usr/bin/env bash
# One arm from two trees of qspec, in alternating processes on one machine: what a range of commits changed, where no
# in-process switch exists for an A/B (e.g. two builds measured on different machine starts).
#
# Usage: benchmarks/ab_trees.sh OLD_TREE OLD_ARM NEW_ARM [ROUNDS] [OUTDIR]
#   OLD_TREE  a directory holding the old tree (e.g. `mkdir .old && git archive 36842cf | tar -x -C .old`, with /.old/
#             in .git/info/exclude so that a copy of the working tree carries it); the new tree is the working directory
#   OLD_ARM   the old tree's arm spec, named apart from the new one's (e.g. `old-ours:from=ours,pdl=1`)
#   NEW_ARM   the new tree's (e.g. `new-ours:from=ours`)
#   ROUNDS    old, new, old, new, ... processes of `--reps 2` each (default 2 rounds: four processes)
#   OUTDIR    defaults to $OUT, then benchmarks/results/local
# The flash-next 8-layer protocol of seed_protocol.sh (MODEL_ARGS replaces its model and device options); BENCH_ARGS
# adds options to every process. Result:
# OUTDIR/ab-trees.{json,md}, the processes combined by `qspec.bench report` (each process's JSON is kept beside it).
set -euo pipefail

old="$(cd "${1:?usage: $0 OLD_TREE OLD_ARM NEW_ARM [ROUNDS] [OUTDIR]}" && pwd)"
old_arm="${2:?old arm spec}"
new_arm="${3:?new arm spec}"
rounds="${4:-2}"
out="${5:-${OUT:-benchmarks/results/local}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
py="${PYTHON:-python}"
read -r -a extra <<< "${BENCH_ARGS:-}"
read -r -a model <<< "${MODEL_ARGS:---preset flash-next --layers 8 --device cuda --dtype bfloat16}"
fn8=("${model[@]}" --accept-profile p=0.85 --reps 2)

one() {  # one TREE ARM FILE: a process in TREE (`python -m` imports the qspec of its working directory)
    (cd "$1" && "$py" -m qspec.bench merge "${fn8[@]}" --arms "$2" ${extra[@]+"${extra[@]}"} --json "$3")
}

files=()
for ((i = 0; i < rounds; i++)); do
    one "$old" "$old_arm" "$out/ab-trees-old-$i.json"
    one "$PWD" "$new_arm" "$out/ab-trees-new-$i.json"
    files+=("$out/ab-trees-old-$i.json" "$out/ab-trees-new-$i.json")
done
"$py" -m qspec.bench report "${files[@]}" --json "$out/ab-trees.json" --markdown "$out/ab-trees.md"
