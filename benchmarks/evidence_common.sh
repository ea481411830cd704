# Sourced by the evidence_*.sh scripts (on the device): where results go ($OUT), Inductor's and Triton's
# caches in the checkout's ignored .cache/, the GPU's name for evidence_record.sh, the package installed.
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }

# At most 8 files come back from a device call: everything but gpu.txt travels as one tarball
# (evidence_record.sh unpacks it).
bundle_out() {
  (cd $OUT && tar czf /tmp/raw.tgz --exclude gpu.txt . && find . -type f ! -name gpu.txt -delete && mv /tmp/raw.tgz .)
}
