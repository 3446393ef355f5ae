#!/usr/bin/env bash
# SageMaker entrypoint for vLLM (with the Neuron plugin on trn2): every SM_VLLM_<NAME>=<value> in the
# container environment becomes `--<name> <value>` of `vllm serve` (NAME lowercased, '_' → '-';
# an empty value gives a bare flag), the same convention as vLLM's
# examples/online_serving/sagemaker-entrypoint.sh and the AWS DLCs. SageMaker sends traffic to port
# 8080 (/ping, /invocations, which vLLM's OpenAI server provides). Values are passed as one argument
# each, so JSON such as SM_VLLM_SPECULATIVE_CONFIG survives intact. The command is $VLLM_CMD
# (default: vllm serve, split on spaces); SageMaker's own `serve` argument is ignored.
# SM_VLLM_PORT / SM_VLLM_HOST are ignored (SageMaker health-checks 8080 on all interfaces).
set -euo pipefail
args=(--port "${SAGEMAKER_BIND_TO_PORT:-8080}" --host 0.0.0.0)
while IFS= read -r -d '' kv; do
  key=${kv%%=*}
  val=${kv#*=}
  [[ $key == SM_VLLM_* ]] || continue
  name=${key#SM_VLLM_}
  name=${name,,}
  if [[ -z $name || $name == port || $name == host ]]; then
    echo "sagemaker-entrypoint: ignoring $key" >&2
    continue
  fi
  args+=("--${name//_/-}")
  [[ -n $val ]] && args+=("$val")
done < <(env -0 | sort -z)
# TIDESPEC_ACCEPTANCE=1 (set by `tidespec deploy sagemaker` with canary.alarm_acceptance): publish the
# engine's live acceptance length to CloudWatch beside it, for the auto-rollback alarm
if [[ ${TIDESPEC_ACCEPTANCE:-0} == 1 ]]; then
  python3 -m tidespec.backends.acceptance &
fi
read -r -a cmd <<< "${VLLM_CMD:-vllm serve}"
exec "${cmd[@]}" "${args[@]}"
