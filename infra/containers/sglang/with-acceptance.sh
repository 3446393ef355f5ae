#!/usr/bin/env bash
# Starts tidespec's acceptance publisher beside SGLang when TIDESPEC_ACCEPTANCE=1 (what `tidespec deploy
# sagemaker` sets with canary.alarm_acceptance), then runs the DLC's own entrypoint
# ($TIDESPEC_BASE_ENTRYPOINT, baked in at build time) with SageMaker's arguments.
set -euo pipefail
if [[ -z ${TIDESPEC_BASE_ENTRYPOINT:-} ]]; then
  echo "with-acceptance: TIDESPEC_BASE_ENTRYPOINT is empty: rebuild with --build-arg BASE_ENTRYPOINT=..." >&2
  exit 2
fi
if [[ ${TIDESPEC_ACCEPTANCE:-0} == 1 ]]; then
  python3 -m tidespec.backends.acceptance &
fi
read -r -a base <<< "$TIDESPEC_BASE_ENTRYPOINT"
exec "${base[@]}" "$@"
