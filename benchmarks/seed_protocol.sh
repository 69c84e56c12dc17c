#!/usr/bin/env bash
# The seed's benchmarks (Rust merge task, context sweep) as named steps, each one process that fits a
# 10-minute limit per command. Usage: benchmarks/seed_protocol.sh STEP [OUTDIR]   (OUTDIR defaults to $OUT, then
# benchmarks/results/local). Results: OUTDIR/STEP.json and .md (and .png where matplotlib is installed);
# combine split sweeps afterwards with `python -m qspec.bench report A.json B.json --json ... --markdown ...
# --plot ...`. Run from the repository root. Extra options for every step: BENCH_ARGS="--reps 1 --gen-tokens 64".
# See benchmarks/README.md.
set -euo pipefail

step="${1:?usage: $0 STEP [OUTDIR]; steps: cpu-embedded-merge cpu-embedded-sweep cpu-embedded-merge-p85 \
h200-embedded-merge h200-embedded-sweep h200-fn8-merge h200-fn8-sweep h200-fn8-sweep-a h200-fn8-sweep-b h200-fn8-ab h200-fn8-attn \
h200-fn8-early h200-fn8-pdl h200-fn8-dvocab h200-fn8-prefill h200-fn8-mixers h200-fn8-depth h200-fn8-seed \
h200-fn8-auto h200-fn8-auto-p30 h200-fn8-depths h200-fn8-depths-a h200-fn8-depths-b h200-fn8-depths-stretch h200-q4km48-depths h200-q4km8 h200-q4km48 h200-q4km48-auto h200-q4km48-fblk h200-q4km48-a h200-q4km48-b h200-q4km48-int8 h200-q4km48-m h200-q4km48-seed h200-q4km48-mtp h200-q4km48-two h200-q4km48-shst h200-q4km48-ssum h200-q4km48-nq h200-q4km48-shpair h200-q4km48-sparse h200-fn8-stretch h200-fn8-stretch-profile h200-q4km48-profile h200-q4km24-load h200-q4km48-first h200-q8048 h200-q8048-mtp5 h200-q4km48-round-profile h200-q4km48-32k h200-q4km48-pairs h200-q4km48-klanes h200-q4km48-batch gpu-fla-configs gpu-serve-q4km8 gpu-compile-cache gpu-batch-seqs gpu-batch-aseqs gpu-batch-seqs-plain gpu-batch-aseqs-plain gpu-batch-aseqs-mtp3 gpu-batch-static-rows gpu-warmup-static-rows gpu-q4km48-host}"
out="${2:-${OUT:-benchmarks/results/local}}"
py="${PYTHON:-python}"
read -r -a extra <<< "${BENCH_ARGS:-}"
mkdir -p "$out"

bench() {  # bench SUBCOMMAND ARGS... -> writes $out/$step.{json,md,png}
    local sub="$1"
    shift
    "$py" -m qspec.bench "$sub" "$@" ${extra[@]+"${extra[@]}"} \
        --json "$out/$step.json" --markdown "$out/$step.md" --plot "$out/$step.png"
}

bench_nearly_full() {  # bench, for a device nearly full of weights: the allocator's expandable segments keep a
    # transient from failing on fragmentation (unless PYTORCH_CUDA_ALLOC_CONF says otherwise)
    PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" bench "$@"
}

fn8=(--preset flash-next --layers 8 --device cuda --dtype bfloat16 --accept-profile p=0.85)
q48=(--preset flash-next --layers 48 --device cuda --dtype bfloat16 --accept-profile p=0.85)

case "$step" in
    # (a) the embedded default model (tiny geometry, Qwen vocabulary, random weights) on the CPU
    cpu-embedded-merge) bench merge --device cpu ;;
    cpu-embedded-sweep) bench sweep --device cpu ;;
    cpu-embedded-merge-p85) bench merge --device cpu --accept-profile p=0.85 ;;
    # (b) the embedded default model on the H200
    h200-embedded-merge) bench merge --device cuda ;;
    h200-embedded-sweep) bench sweep --device cuda ;;
    # (c) flash-next geometry, 8 layers (~24.7 B parameters with the MTP block, ~49 GB bf16, built on the GPU),
    #     replayed acceptance p=0.85; the sweep is split in two processes to fit the per-command time limit
    h200-fn8-merge) bench merge "${fn8[@]}" ;;
    h200-fn8-sweep-a) bench sweep "${fn8[@]}" --contexts 512,1024,2048 ;;
    h200-fn8-sweep-b) bench sweep "${fn8[@]}" --contexts 4096,6144 ;;
    #     with prefill's experts as grouped GEMMs a prompt prefills in well under a second, and the whole sweep fits one
    #     process (89.6 s at 6f7f8ee; its JSON is rewritten after every run, in case a limit cuts it)
    h200-fn8-sweep) bench sweep "${fn8[@]}" --contexts 512,1024,2048,4096,6144 ;;
    # (d) what qspec's own GPU work buys, as ratios within one process: torch.compile-fused step math on/off,
    #     the Triton one-row mat-vec vs cuBLAS, sparse QSA attention on/off (not part of the seed's protocol)
    h200-fn8-ab) bench merge "${fn8[@]}" --arms "nospec,nospec-unfused:from=nospec,compile=0,\
nospec-cublas:from=nospec,gemv=0,ours,ours-unfused:from=ours,compile=0,ours-cublas:from=ours,gemv=0,\
ours-sparse:from=ours,sparse=1" ;;
    # (d2) masked attention in one Triton pass over the cache (the default on CUDA since 380c29e) against
    #     the dequantized read (fattn=0), same run; ours twice (first and last) to show the spread of one build
    h200-fn8-attn) bench merge "${fn8[@]}" --arms "nospec,nospec-dqread:from=nospec,fattn=0,ours,\
ours-dqread:from=ours,fattn=0,ours-again:from=ours" ;;
    # (d3) the next round's draft chain queued before the round's read-back (early, the default since
    #      ac3dd2c) against after it (late), same run, each twice
    h200-fn8-early) bench merge "${fn8[@]}" --arms "ours-late:from=ours,early=0,ours,ours-late-again:from=ours,\
early=0,ours-again:from=ours" ;;
    # (d4) programmatic dependent launch (Hopper; the default since the commit after 36842cf) against launches that wait
    #      for the kernel before, plain decoding and MTP5
    h200-fn8-pdl) bench merge "${fn8[@]}" --arms "nospec-nopdl:from=nospec,pdl=0,nospec,ours-nopdl:from=ours,pdl=0,\
ours,ours-nopdl-again:from=ours,pdl=0" ;;
    # (d5) a draft vocabulary (the draft head reads only the rows of the first 32,768 / 16,384 ids) against the whole
    #      vocabulary, MTP5 and MTP3. Replayed acceptance: this measures the head's cost only; what the vocabulary
    #      costs in acceptance is the real model's (scripts/draft_vocab_demo.py measures it for the demo model)
    h200-fn8-dvocab) bench merge "${fn8[@]}" --arms "ours,ours-dv32k:from=ours,dvocab=32768,\
ours-dv16k:from=ours,dvocab=16384,ours-mtp3:from=ours,draft=3,ours-mtp3-dv32k:from=ours,draft=3,dvocab=32768" ;;
    # (d6) prefill's routed experts as three grouped GEMMs per layer (the default on sm_90/sm_100 since 8db82fe)
    #      against the loop over the experts: the report's prefill column (and the decode speed, which must not change)
    h200-fn8-prefill) bench merge "${fn8[@]}" --arms "nospec-loop:from=nospec,gmm=0,nospec,ours-loop:from=ours,gmm=0,ours" ;;
    # (d7) the hyper-connection mixers of verify and extend steps (6 rows) on the Triton kernels (the default since
    #      8db82fe) against compiled mixers for every step above one row
    h200-fn8-mixers) bench merge "${fn8[@]}" --arms "ours-hc1:from=ours,hcrows=1,ours,ours-hc1-again:from=ours,\
hcrows=1,ours-again:from=ours" ;;
    # (e) draft depth with every optimization on: does MTP5 beat MTP3 on this engine (the seed's claim)?
    h200-fn8-depth) bench merge "${fn8[@]}" --arms "nospec,ours-mtp3:from=ours,draft=3,ours-mtp4:from=ours,draft=4,ours" ;;
    # (f) the merge task's three arms and ours at MTP3 and MTP4 in one process: Figure 1 and the depth question together
    h200-fn8-seed) bench merge "${fn8[@]}" --arms "nospec,baseline,ours-mtp3:from=ours,draft=3,ours-mtp4:from=ours,draft=4,ours" ;;
    # (g) the automatic draft depth (--draft auto:6) against MTP3 and MTP5, at p=0.85 and at p=0.3 (where drafting
    #     does not pay)
    h200-fn8-auto) bench merge "${fn8[@]}" --arms "nospec,ours-mtp3:from=ours,draft=3,ours,ours-auto:from=ours,auto=1,draft=6" ;;
    h200-fn8-auto-p30) bench merge "${fn8[@]}" --accept-profile p=0.3 \
        --arms "nospec,ours-mtp1:from=ours,draft=1,ours-mtp3:from=ours,draft=3,ours,ours-auto:from=ours,auto=1,draft=6" ;;
    #     auto:8 against plain and every fixed depth 1..8, per acceptance profile (scripts/gpu_depth.py: one process
    #     per step, the model compiled once): geometric p (a fresh stream per generation, the same for every arm) and
    #     the demo model's traces, all in one step (~400 s at 27da8b6: the first profile ~170 s with the compilation,
    #     each next one ~35 s) or split in two
    h200-fn8-depths) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/gpu_depth.py --layers 8 --reps 2 --gen-tokens 256 --out "$out/$step" \
        --profile p=0.3,fresh=1 --profile p=0.5,fresh=1 --profile p=0.7,fresh=1 --profile p=0.85,fresh=1 \
        --profile p=0.95,fresh=1 --profile trace=benchmarks/results/demo-accept-trace-code-long.json \
        --profile trace=benchmarks/results/demo-accept-trace-prose-long.json ;;
    h200-fn8-depths-a) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/gpu_depth.py --layers 8 --reps 2 --gen-tokens 256 --out "$out/$step" \
        --profile p=0.3,fresh=1 --profile p=0.5,fresh=1 --profile p=0.7,fresh=1 --profile p=0.85,fresh=1 ;;
    h200-fn8-depths-b) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/gpu_depth.py --layers 8 --reps 2 --gen-tokens 256 --out "$out/$step" \
        --profile p=0.95,fresh=1 --profile trace=benchmarks/results/demo-accept-trace-code-long.json \
        --profile trace=benchmarks/results/demo-accept-trace-prose-long.json ;;
    #     first plain stretches of 16 tokens (auto, the default; the longest 8 times that) against 8 and 32 (auto-s8,
    #     auto-s32), beside plain decoding and MTP2/3
    h200-fn8-depths-stretch) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/gpu_depth.py --layers 8 --reps 3 --gen-tokens 256 \
        --max-depth 6 --fixed 2,3 --stretches 8,32 --out "$out/$step" --profile p=0.5,fresh=1 --profile p=0.7,fresh=1 ;;
    h200-q4km48-depths) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/gpu_depth.py --layers 48 --quant q4_k_m \
        --max-depth 6 --reps 1 --gen-tokens 256 --out "$out/$step" --profile p=0.85,fresh=1 \
        --profile p=0.5,fresh=1 ;;
    # (h) block weights (llama.cpp's per-tensor types, generated and quantized on the GPU): 8 layers Q4_K_M, the
    #     geometry of the llama.cpp comparison file; the whole 48 layers Q4_K_M (plain, MTP3 and MTP5 in one process;
    #     or split in two processes: the build, the warm-ups and a 4,096-token prefill per run); the int8-activation
    #     products against the f32 expansion, and 4,096-token prefill steps (the block models' default) against 512;
    #     48 layers Q8_0 (~137 GB of weights: whether it fits); the functions around the block products compiled (the
    #     default) against eager (fblk=0), plain and MTP3, with --draft auto:6 beside them (one compilation for all)
    h200-q4km8) bench merge "${fn8[@]}" --quant q4_k_m --arms "nospec,ours-mtp3:from=ours,draft=3,ours" ;;
    h200-q4km48) bench merge "${q48[@]}" --quant q4_k_m --reps 1 --arms "nospec,ours-mtp3:from=ours,draft=3,ours" ;;
    h200-q4km48-auto) bench merge "${q48[@]}" --quant q4_k_m --reps 1 --gen-tokens 256 \
        --arms "nospec,ours-mtp3:from=ours,draft=3,ours,ours-auto:from=ours,auto=1,draft=6" ;;
    h200-q4km48-fblk) bench merge "${q48[@]}" --quant q4_k_m --reps 1 --gen-tokens 256 --arms "nospec-eager:\
from=nospec,fblk=0,nospec,ours-mtp3-eager:from=ours,draft=3,fblk=0,ours-mtp3:from=ours,draft=3,\
ours-auto:from=ours,auto=1,draft=6" ;;
    h200-q4km48-m) bench merge "${q48[@]}" --quant q4_k_m --reps 1 --gen-tokens 256 \
        --arms "nospec,ours-mtp3:from=ours,draft=3,ours" ;;
    #     the seed's protocol in full (512 generated, 3 runs per arm, the baseline MTP3 beside ours at depths 3 and 5)
    h200-q4km48-seed) bench merge "${q48[@]}" --quant q4_k_m --reps 3 --arms "nospec,baseline,ours-mtp3:from=ours,draft=3,ours" ;;
    #     the merge task without the baseline arm (whose first runs capture their graphs while timed): plain
    #     decoding, MTP3 and MTP5, 3 runs each
    h200-q4km48-mtp) bench merge "${q48[@]}" --quant q4_k_m --reps 3 --arms "nospec,ours-mtp3:from=ours,draft=3,ours" ;;
    #     plain decoding and MTP5 only: fits a 600 s call on a machine without compilation caches
    h200-q4km48-two) bench merge "${q48[@]}" --quant q4_k_m --reps 1 --gen-tokens 256 --arms "nospec,ours" ;;
    #     the shared expert on its side stream (the default) against one stream, plain decoding; MTP5 beside them
    h200-q4km48-shst) bench merge "${q48[@]}" --quant q4_k_m --reps 1 --gen-tokens 256 \
        --arms "nospec,nospec-1stream:from=nospec,shst=0,ours" ;;
    #     split products' partial sums added in the product's launch (the default) against a launch of their own,
    #     plain decoding, 3 runs each (h200-q4km48-ssum-3ab9df5 ran MTP5 beside them)
    h200-q4km48-ssum) bench merge "${q48[@]}" --quant q4_k_m --reps 3 --gen-tokens 256 \
        --arms "nospec,nospec-apart:from=nospec,ssum=0" ;;
    #     MTP5 with the tensor-core products' K-quants expanded two weights a register (the default) against f32,
    #     with their split sums in their launch (the default) against a launch apart, and with the shared expert as
    #     its own (tensor-core) products instead of one more routed pair (which 6 rows read 6 times); 2 runs each
    h200-q4km48-pairs) bench merge "${q48[@]}" --quant q4_k_m --reps 2 --gen-tokens 256 \
        --arms "ours,ours-f32:from=ours,pairs=0,ours-apart:from=ours,ssum=0,ours-ownshared:from=ours,shpair=0" ;;
    #     the GDN output's gated norm quantized for its product in one launch (the default) against the compiled
    #     norm and the product's own quantizer, plain decoding, 3 runs each
    h200-q4km48-nq) bench merge "${q48[@]}" --quant q4_k_m --reps 3 --gen-tokens 256 \
        --arms "nospec,nospec-nq0:from=nospec,nq=0" ;;
    #     the shared expert as one more routed pair (the default) against its own products on a side stream, plain
    #     decoding and MTP5, 2 runs each
    h200-q4km48-shpair) bench merge "${q48[@]}" --quant q4_k_m --reps 2 --gen-tokens 256 \
        --arms "nospec,nospec-apart:from=nospec,shpair=0,ours,ours-apart:from=ours,shpair=0" ;;
    #     Q4_K/Q5_K products with each row's K in lanes by the matrix's shape (the default) against one lane and
    #     against 2 for every matrix (--k-lanes), plain decoding and MTP3, 2 runs each
    h200-q4km48-klanes) bench merge "${q48[@]}" --quant q4_k_m --reps 2 --gen-tokens 256 \
        --arms "nospec,nospec-kl1:from=nospec,klanes=1,nospec-kl2:from=nospec,klanes=2,\
ours-mtp3:from=ours,draft=3,ours-mtp3-kl1:from=ours,draft=3,klanes=1" ;;
    #     QSA reading only the indexer's chosen blocks and the tail (--sparse-attention) against the masked dense
    #     pass (the default), plain decoding and MTP5, 2 runs each
    h200-q4km48-sparse) bench merge "${q48[@]}" --quant q4_k_m --reps 2 --gen-tokens 256 \
        --arms "nospec,nospec-sparse:from=nospec,sparse=1,ours,ours-sparse:from=ours,sparse=1" ;;
    #     --draft auto with 16-token first plain stretches (the default) against 8, beside plain decoding, at p = 0.5
    #     (another profile: BENCH_ARGS="--accept-profile p=0.7")
    h200-fn8-stretch) bench merge "${fn8[@]}" --accept-profile p=0.5 --reps 3 --gen-tokens 256 \
        --arms "nospec,auto:from=ours,auto=1,draft=6,auto-s8:from=ours,auto=1,draft=6,stretch=8" ;;
    #     where a 48-layer Q4_K_M decode step's time goes (kernels per token, GPU busy and idle)
    #     where a plain stretch's time goes beyond plain decoding's (8 layers: auto:6 held at depth 0 against draft 0,
    #     256 tokens each, profiled)
    h200-fn8-stretch-profile) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/profile_step.py --preset flash-next --layers 8 \
        --kinds decode --draft 6 --e2e 256 --e2e-stretch | tee "$out/$step.txt" ;;
    h200-q4km48-profile) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/profile_step.py --preset flash-next --layers 48 \
        --quant q4_k_m --kinds decode --e2e 64 --top 45 | tee "$out/$step.txt" ;;
    #     where an MTP5 round's time goes at 48 layers: the verify, draft and extend steps' kernels, then 16 rounds
    #     end to end (replayed p = 0.85)
    h200-q4km48-round-profile) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/profile_step.py --preset flash-next \
        --layers 48 --quant q4_k_m --kinds verify,draft,extend --draft 5 --e2e 16 --top 30 | tee "$out/$step.txt" ;;
    #     a 32,768-token context (its caches allocated in full) beside the 8,192 of the merge task: plain decoding
    #     and MTP5 after 4,096 and 14,000 prompt tokens (the shipped prompt's longest: 14,140), 1 run each
    h200-q4km48-32k) bench sweep "${q48[@]}" --quant q4_k_m --ctx 32768 --contexts 4096,14000 --reps 1 \
        --gen-tokens 128 --arms "nospec,ours" ;;
    h200-q4km48-a) bench merge "${q48[@]}" --quant q4_k_m --arms "nospec,baseline" ;;
    h200-q4km48-b) bench merge "${q48[@]}" --quant q4_k_m --arms "ours-mtp3:from=ours,draft=3,ours" ;;
    h200-q4km48-int8) bench merge "${q48[@]}" --quant q4_k_m --reps 1 --arms "nospec,nospec-f32:from=nospec,int8=0,\
nospec-chunk512:from=nospec,prefill_chunk=512" ;;
    #     a large Q4_K_M GGUF written from tensors drawn on the GPU, then loaded by a fresh process from the disk:
    #     load time, peak host memory, first tokens, decode; then a second fresh process with the compilation caches
    #     warm (24 layers, 41.6 GiB: no 48-layer file fits the disk; over 370 s at 10617d2, the write and each
    #     process's load included; LOAD_LAYERS=16 for a 29.1 GiB file; LOAD_KEEP=1 keeps the file for a second
    #     run, LOAD_ARGS="--reuse-file --compile-prefill" loads it again with the prompt's steps compiled)
    h200-q4km24-load) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/gguf_load.py --layers "${LOAD_LAYERS:-24}" --quant q4_k_m ${LOAD_ARGS:-} \
        --file "${LOAD_FILE:-/var/tmp/qspec-load.gguf}" --out "$out/$step"; rc=$?; [ -n "${LOAD_KEEP:-}" ] || rm -f "${LOAD_FILE:-/var/tmp/qspec-load.gguf}"
        exit $rc ;;
    #     the first tokens of fresh processes (empty compilation caches, then warm) at 48 layers: no 48-layer file
    #     fits the disk, so each process builds the model on the device (scripts/gguf_load.py --drawn)
    h200-q4km48-first) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/gguf_load.py --drawn --layers 48 --quant q4_k_m \
        --tokens 64 --out "$out/$step" ;;
    # (the Q8_0 weights fill 127.66 GiB: a 3 GiB scratch failed on fragmentation without expandable segments)
    h200-q8048) bench_nearly_full merge "${q48[@]}" --quant q8_0 --reps 1 --arms "nospec,ours-mtp3:from=ours,draft=3" ;;
    #     MTP5 beside plain decoding in Q8_0 (the device's memory nearly full: 1 run each)
    h200-q8048-mtp5) bench_nearly_full merge \
        "${q48[@]}" --quant q8_0 --reps 1 --arms "nospec,ours" ;;
    # continuous batching at the whole model's depth: 1-8 requests of 512-token prompts, plain steps and MTP3 rounds
    # (always, and by measured choice) against the engine's one request (scripts/batch_gpu.py)
    h200-q4km48-batch) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/batch_gpu.py --layers 48 --quant q4_k_m \
        --batches 1,2,4,8 --prompt 512 --tokens 128 --reps 1 --draft 3 --modes on,auto --out "$out/$step.md" ;;
    # a batch's GDN launches for all its sequences (the default) against each sequence's own, then its attention's
    #   (also the default), in the same process: 4 and 8 requests, plain and MTP3 (8 Q4_K_M layers; any GPU)
    gpu-batch-seqs) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/batch_gpu.py --layers 8 --quant q4_k_m --batches 4,8 \
        --prompt 512 --tokens 128 --reps 2 --draft 3 --switches gdn_seqs=0 --out "$out/$step.md" ;;
    gpu-batch-aseqs) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/batch_gpu.py --layers 8 --quant q4_k_m --batches 4,8 \
        --prompt 512 --tokens 128 --reps 2 --draft 3 --switches attention_seqs=0 --out "$out/$step.md" ;;
    #   the same A/Bs of 8 requests alone, plain (2 runs of 128 tokens) and MTP3 (1 run of 64: 172 s on a warm H100)
    gpu-batch-seqs-plain) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/batch_gpu.py --layers 8 --quant q4_k_m \
        --batches 8 --prompt 512 --tokens 128 --reps 2 --switches gdn_seqs=0 --out "$out/$step.md" ;;
    gpu-batch-aseqs-plain) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/batch_gpu.py --layers 8 --quant q4_k_m \
        --batches 8 --prompt 512 --tokens 128 --reps 2 --switches attention_seqs=0 --out "$out/$step.md" ;;
    gpu-batch-aseqs-mtp3) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/batch_gpu.py --layers 8 --quant q4_k_m \
        --batches 8 --prompt 512 --tokens 64 --reps 1 --draft 3 --switches attention_seqs=0 --out "$out/$step.md" ;;
    # the whole model on a GPU too small for it: 48 Q4_K_M layers, the routed experts of the first HOST_LAYERS layers
    #   (default 12) in page-locked host memory, read over PCIe (--host-experts); plain, MTP3 and MTP5, 1 run of 128.
    #   Without expandable segments, on an H100 at bae8ffa, the drawn model's build left 17.75 GiB reserved but
    #   unallocated and ran out of memory (benchmarks/results/h100-pytest-cuda-host-experts-bae8ffa.txt)
    gpu-q4km48-host) bench_nearly_full merge "${q48[@]}" --quant q4_k_m --reps 1 --gen-tokens 128 \
        --host-experts "${HOST_LAYERS:-12}" --arms "nospec,ours-mtp3:from=ours,draft=3,ours" ;;
    # batches' steps (more than one row) compiled at symbolic sizes (EngineOptions.static_rows=1) against the default
    #   static sizes, same process: 4 and 8 requests, plain (8 Q4_K_M layers; any GPU)
    gpu-batch-static-rows) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/batch_gpu.py --layers 8 --quant q4_k_m \
        --batches 4,8 --prompt 512 --tokens 128 --reps 2 --switches static_rows=1 --out "$out/$step.md" ;;
    # a server's warm-up (scripts/serve_warmup.py: 8 Q4_K_M layers, a request alone, then batches of 1-4) with steps of
    #   more than one row at symbolic sizes (--static-rows 1), then at static sizes (the default), each process with
    #   empty compilation caches of its own, each cut at WARMUP_LIMIT seconds (default 280), WARMUP_BATCH the largest
    #   batch (default 4; any GPU)
    gpu-warmup-static-rows) for rows in 1 16; do
            d=$(mktemp -d)
            echo "== --static-rows $rows" | tee -a "$out/$step.log"
            TORCHINDUCTOR_CACHE_DIR="$d/inductor" TRITON_CACHE_DIR="$d/triton" QSPEC_CACHE_DIR="$d/qspec" \
                PYTHONPATH=".:${PYTHONPATH:-}" timeout "${WARMUP_LIMIT:-280}" "$py" scripts/serve_warmup.py --layers 8 \
                --quant q4_k_m --max-batch "${WARMUP_BATCH:-4}" --static-rows "$rows" 2>&1 | tee -a "$out/$step.log" || true
        done ;;
    # whether a second process finds the Triton kernels a first one compiled (scripts/compile_cache.py: 8 Q4_K_M layers,
    # a first request, then the products of a server's batch sizes 1-8; any GPU)
    gpu-compile-cache) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/compile_cache.py --layers 8 --quant q4_k_m \
        --rows 1,2,3,4,5,6,7,8 --out "$out/$step" ;;
    # the server under load (scripts/serve_gpu.py): an 8-layer Q4_K_M GGUF written on the device, `qspec serve` plain and
    # MTP3 (replayed acceptance) with --max-batch 8, `qspec bench serve` with 1, 4 and 8 clients at once (any GPU). A
    # server's warm-up on a fresh machine took minutes (BENCHMARKS.md §9): SERVE_SERVERS="plain=--draft 0" runs the plain
    # server alone
    gpu-serve-q4km8) PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/serve_gpu.py --layers 8 --quant q4_k_m \
        --file "${SERVE_FILE:-/var/tmp/qspec-serve.gguf}" --concurrency 1,4,8 \
        ${SERVE_SERVERS:+--servers "$SERVE_SERVERS"} --out "$out/$step" ;;
    # fla's chunked prefill kernels on this GPU: autotune them at the flash-next geometry and write their configs into
    # qspec/assets/fla_configs/<GPU>/ (copied to OUTDIR/fla_configs, to be committed), then time a fresh process's
    # first call with and without them (qspec/kernels/fla_configs.py; any GPU, the step's name says which it is for)
    gpu-fla-configs) { PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/fla_configs.py write && \
        PYTHONPATH=".:${PYTHONPATH:-}" "$py" scripts/fla_configs.py time; } | tee "$out/$step.txt"
        cp -r qspec/assets/fla_configs "$out/" ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
esac
