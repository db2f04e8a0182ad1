#!/usr/bin/env bash
# The numerical tests under every instruction set this CPU offers to torch (ATEN_CPU_CAPABILITY),
# to MKL (MKL_ENABLE_INSTRUCTIONS) and to numpy's OpenBLAS (OPENBLAS_CORETYPE): kernels that sum
# in other orders, as on other CPUs. Prints one line per setting: passed/failed counts.
#
#   bash benchmarks/instruction_sets.sh                 # mogo's tests and the NFT/advantage maths
#   bash benchmarks/instruction_sets.sh tests/test_gram.py
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_*.py mogo tests/diffusion/test_nft.py tests/diffusion/test_advantages.py)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1
python benchmarks/machine.py
run() {  # label, then VAR=value settings
    local label=$1; shift
    local summary
    summary=$(env "$@" python -m pytest -q "${tests[@]}" 2>&1 | tail -1)
    printf '| %s | %s |\n' "$label" "$summary"
}
echo "| setting | pytest summary |"
echo "|---|---|"
for aten in default avx2 avx512; do
    for mkl in SSE4_2 AVX2 AVX512; do
        run "ATEN_CPU_CAPABILITY=$aten MKL_ENABLE_INSTRUCTIONS=$mkl" ATEN_CPU_CAPABILITY=$aten MKL_ENABLE_INSTRUCTIONS=$mkl
    done
done
for core in Haswell SkylakeX Zen; do
    run "OPENBLAS_CORETYPE=$core" OPENBLAS_CORETYPE=$core
done
