# shellcheck shell=bash
# The environment both sides of a qkv-against-PyTorch comparison run in, set the same for each
# (the chroots included: scripts/test-in-debian.sh passes these variables in). Sourced by
# scripts/bench.sh and scripts/bench_lm.sh, not run.

# The scripts' option values, checked before anything is built or run: exit status 2 naming the
# option, what it takes and what came. Unchecked, a bad value failed only in qkv-bench after a case
# had run, ran on (a negative --min-time), or wrote an empty table over the last results (--rounds 0).
#   expect_value SCRIPT OPTION REMAINING    the option has a value after it ($# at the option)
#   expect_whole SCRIPT OPTION VALUE MIN MAX
#   expect_real SCRIPT OPTION VALUE LOW HIGH [true: LOW included]    a decimal number up to HIGH
#   expect_regex SCRIPT OPTION VALUE            an extended regular expression grep takes
expect_value() {
  [[ $3 -ge 2 ]] && return 0
  echo "$1: $2 takes a value (see --help)" >&2
  exit 2
}
expect_whole() {
  [[ $3 =~ ^[0-9]{1,9}$ ]] && ((10#$3 >= $4 && 10#$3 <= $5)) && return 0
  echo "$1: $2 takes a whole number from $4 to $5, got '$3'" >&2
  exit 2
}
expect_real() {
  local low_included=${6:-false} lowest="above $4"
  $low_included && lowest="from $4"
  [[ $3 =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] &&
    awk -v v="$3" -v low="$4" -v high="$5" -v closed="$low_included" \
      'BEGIN { v += 0; exit !((v > low + 0 || (closed == "true" && v == low + 0)) && v <= high + 0) }' && return 0
  echo "$1: $2 takes a number $lowest up to $5, got '$3'" >&2
  exit 2
}
expect_regex() {
  local status=0
  grep -Eq -- "$3" < /dev/null 2> /dev/null || status=$?
  [[ $status -ne 2 ]] && return 0
  echo "$1: $2 takes an extended regular expression (grep -E), got '$3'" >&2
  exit 2
}

# OpenBLAS may run kernels below the CPU's: Debian 12's takes an Intel Xeon of the Emerald Rapids
# generation for an old CPU and runs its generic kernels, and an OPENBLAS_CORETYPE in the
# environment may name an older core than the CPU's (Haswell, AVX2, on an AMD Zen 5 with AVX-512:
# 1.8x slower). That sets the speed of LibTorch's float32 products on both sides of the comparison;
# qkv-bench says which OPENBLAS_CORETYPE fits, and it is set for every side in place of the
# environment's.
#   use_fitting_openblas_core QKV_BENCH NAME     NAME: the script's name for its message
use_fitting_openblas_core() {
  local coretype
  coretype=$("$1" --blas-advice | grep -o 'run with OPENBLAS_CORETYPE=[A-Z0-9]*' | cut -d= -f2 || true)
  if [[ -n "$coretype" ]]; then
    echo "$2: OpenBLAS would run kernels below this CPU's${OPENBLAS_CORETYPE:+ (OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE in the environment)}: OPENBLAS_CORETYPE=$coretype for every side" >&2
    export OPENBLAS_CORETYPE=$coretype
  fi
}

# glibc's malloc maps every block above its mmap threshold (128 KiB at first, rising to at most
# 32 MiB as such blocks are freed) afresh and unmaps it when freed, and trims the heap's top, so a
# step's tensors fault their pages in again on many steps, by chance: on the AMD EPYC VM of
# 2026-12-03 the module step (B=8 N=512 E=256) took 83-88 ms at the defaults against 38-40 ms
# with the setting below, PyTorch 2.14's the same step 93 against 58 ms, and repetitions of one
# case swung by 3x. Both sides therefore run with qkv-train's setting (mmap threshold 32 MiB, trim
# threshold 256 MiB: apps/common/cli_support.h), given to every process as glibc's tunables (so
# qkv-train leaves malloc as the environment sets it), the same for each, so that a table compares
# the arithmetic rather than the page faults. Where the environment sets malloc's thresholds
# itself, both sides run with the environment's.
# Blocks above 32 MiB (the largest threshold glibc takes) are still mapped afresh on every
# allocation, 4 KiB page by page; glibc.malloc.hugetlb=1 asks the kernel for transparent huge pages
# there (where /sys/kernel/mm/transparent_hugepage/enabled says madvise or always), 2 MiB a fault.
# On the AMD EPYC Zen 5 VM, 2026-12-08 (qkv-bench, interleaved runs): the learned (1, 8, 1024, 1024)
# bias's case, whose 32 MiB gradient is such a block, 74-90 -> 25 ms; the N=512 bias 36 -> 33, the
# medium module step 42-44 -> 40-42, the other cores within 3%. Given to both sides with the
# thresholds (README.md, "The allocator", says how a program sets it).
use_same_malloc_setting() {
  # The thresholds unless the environment sets one (as qkv-train decides), the huge pages unless it
  # sets them: a hugetlb tunable alone leaves the thresholds to this, as it does in qkv-train.
  if [[ "${GLIBC_TUNABLES:-}" != *glibc.malloc.mmap_threshold* && "${GLIBC_TUNABLES:-}" != *glibc.malloc.trim_threshold* &&
        -z "${MALLOC_MMAP_THRESHOLD_:-}" && -z "${MALLOC_TRIM_THRESHOLD_:-}" ]]; then
    export GLIBC_TUNABLES=${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456
  fi
  [[ "${GLIBC_TUNABLES:-}" == *glibc.malloc.hugetlb* ]] || export GLIBC_TUNABLES=${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1
}

# This CPU made to look like one without some of its instructions, for the figures of a kind of CPU
# that is not at hand (issue 21's tiers: AMX, AVX512_BF16 only, neither): qkv's kernels and
# bfloat16 routes (QKV_TILED_ISA), LibTorch's vector loops (ATEN_CPU_CAPABILITY), oneDNN's JIT
# kernels (ONEDNN_MAX_CPU_ISA) and OpenBLAS's (OPENBLAS_CORETYPE) each capped, for every side.
# What it does not change: the caches, memory and clock, and the loops GCC clones per instruction
# set (qkv's rounding and widening), which still run their widest clone.
#   emulate_cpu KIND NAME     KIND: avx2 (AMD Zen 2/3, Intel without AVX-512) or avx512 (AVX-512
#                             without AVX512_BF16 or AMX: Intel Skylake-SP, Ice Lake); NAME as above
emulate_cpu() {
  case $1 in
    avx2) export QKV_TILED_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell ;;
    avx512) export QKV_TILED_ISA=avx512 ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE OPENBLAS_CORETYPE=SkylakeX ;;
    *) echo "$2: --emulate takes avx2 or avx512, got '$1'" >&2; exit 2 ;;
  esac
  local needed=$1
  [[ $needed == avx512 ]] && needed=avx512f
  if ! grep -qw "$needed" /proc/cpuinfo; then
    echo "$2: --emulate $1 needs a CPU with $needed (this one has none)" >&2
    exit 2
  fi
  echo "$2: emulating a CPU with $1 and no bfloat16 instructions: QKV_TILED_ISA=$QKV_TILED_ISA ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA=$ONEDNN_MAX_CPU_ISA OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE" >&2
}
