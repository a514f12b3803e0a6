export OUT
scripts/gpu-check.sh build
for i in 1 2; do
  for s in rule ROPEKV_CUDA_SMALL_WIDE=0 "ROPEKV_CUDA_SMALL_WIDE=0 ROPEKV_CUDA_NORM64_TOKENS=0"; do
    echo "== setting $s run $i"
    d=/tmp/sw-$i-${s//[ =]/_}
    (if [ "$s" != rule ]; then export $s; fi
     OUT=$d OPTIONS_ARGS='--option-models "Llama-3.1-8B,Gemma-4 full" --option-cases "plain,QK-norm,QK-norm + fp8 + yarn,QK-norm + float32 pools" --option-tokens 1,32,64,128,192,224,256' \
       scripts/gpu-check.sh options > /dev/null)
    grep "^| " $d/gpu_options.md | cut -d'|' -f2-6
  done
done 2>&1 | tee $OUT/sweep.txt
OPTIONS_ARGS='--option-tokens 1,32,256,512,1024,8192,32768' scripts/gpu-check.sh options
